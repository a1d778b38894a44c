"""When an untouched step holds the budget (runtime/untouched.py, module Rule 2): a margin
beside the plan until the call's steps are read, then the latest reading. The CPU cases fake
CUDA's reading of device memory and of the step's peak."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import superneurons as sn
from superneurons.runtime import module, untouched
from superneurons.runtime.calibration import CALIBRATION_STEPS, SLACK_SHARE


def _net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(8, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


X, Y = torch.randn(16, 8, 16, 16), torch.randint(0, 10, (16,))
LIVENESS = sn.plan(_net(), X, policy="liveness").peak_bytes
ROOMY = LIVENESS + int(untouched.UNTOUCHED_MARGIN * LIVENESS)    # untouched once warm


class FakeDevice:
    """Device memory read as on CUDA: nothing the model does not own, and each step's peak
    the liveness plan's plus ``excess`` (set before the step)."""

    def __init__(self, monkeypatch):
        self.excess = 0
        monkeypatch.setattr(module, "reads_device_memory", lambda device: True)
        monkeypatch.setattr(module, "foreign_bytes", lambda *args, **kwargs: 0)
        monkeypatch.setattr(untouched, "peak_allocated_bytes",
                            lambda device: LIVENESS + self.excess)


def _train(model, excesses, device=None):
    """SGD steps with momentum; per step (loss, whether it ran untouched) for a wrapper."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    steps = []
    for excess in excesses:
        if device is not None:
            device.excess = excess
        optimizer.zero_grad()
        loss = F.cross_entropy(model(X), Y)
        ran_untouched = getattr(model, "_last", (None, None))[1] is None
        loss.backward()
        optimizer.step()
        steps.append((loss.detach(), ran_untouched))
    return steps


def _same_losses(steps, plain_steps):
    return all(torch.equal(a, b) for (a, _), (b, _) in zip(steps, plain_steps))


@pytest.mark.parametrize("policy", ["superneurons", "auto"])
def test_a_call_warms_up_managed_and_runs_untouched_only_with_the_margin(monkeypatch, policy):
    """Rules 1 and 2: the first step is managed (its convolutions' engines fitted); a budget
    within the margin of liveness stays managed."""
    device = FakeDevice(monkeypatch)
    plain = _train(_net(), [0] * 3)
    near = sn.wrap(_net(), policy=policy, budget=LIVENESS + LIVENESS // 16)
    steps = _train(near, [0] * 3, device)
    assert [u for _, u in steps] == [False] * 3 and _same_losses(steps, plain)
    roomy = sn.wrap(_net(), policy=policy, budget=ROOMY)
    steps = _train(roomy, [0] * 3, device)
    assert [u for _, u in steps] == [False, True, True] and _same_losses(steps, plain)


def test_off_cuda_neither_warm_up_nor_margin_applies():
    wrapped = sn.wrap(_net(), budget=LIVENESS)
    assert [u for _, u in _train(wrapped, [0, 0])] == [True, True]
    assert not wrapped._untouched.excess and not wrapped._untouched.warmups


@pytest.mark.filterwarnings("ignore:superneurons. a training step peaked")    # Rule 4
@pytest.mark.parametrize("excesses, ran_untouched", [
    ([0, 0, 0, 0], [False, True, True, True]),
    ([0, LIVENESS // 4, 0, 0], [False, True, False, False]),
    ([0, 0, LIVENESS // 4, 0], [False, True, True, False]),
    # Rule 2: an excess no plan fits beside; the managed plan's executor calibrates it itself
    ([0, 10 * LIVENESS, 0, 0], [False, True, False, False]),
])
def test_the_latest_reading_decides_the_next_step(monkeypatch, excesses, ran_untouched):
    device = FakeDevice(monkeypatch)
    assert LIVENESS // 4 > ROOMY - LIVENESS                   # passes the margin when read
    assert int(SLACK_SHARE * ROOMY) <= ROOMY - LIVENESS       # a reading of 0 fits
    wrapped = sn.wrap(_net(), budget=ROOMY)
    steps = _train(wrapped, excesses, device)
    assert [u for _, u in steps] == ran_untouched
    assert _same_losses(steps, _train(_net(), excesses))


@pytest.mark.filterwarnings("ignore:superneurons. a training step peaked")    # Rule 4
def test_a_reading_across_another_wrappers_forward_is_dropped(monkeypatch):
    device = FakeDevice(monkeypatch)
    first, other = sn.wrap(_net(), budget=ROOMY), sn.wrap(_net(), budget=ROOMY)
    device.excess = LIVENESS          # would make either wrapper's next steps managed
    for step in range(3):
        loss = F.cross_entropy(first(X), Y)
        F.cross_entropy(other(X), Y).backward()       # resets the peak statistic
        loss.backward()
    assert not first._untouched.excess and first._last[1] is None
    assert other._untouched.excess                    # its own step was read


def test_hooks_do_not_gather_on_steps_without_a_backward(monkeypatch):
    device = FakeDevice(monkeypatch)
    wrapped = sn.wrap(_net(), budget=ROOMY)
    _train(wrapped, [0], device)                      # the managed warm-up
    outs = [wrapped(X) for _ in range(3)]
    assert all(not out._backward_hooks for out in outs[:2])
    assert len(wrapped._untouched._pending) == 1
    F.cross_entropy(outs[2], Y).backward()
    assert not wrapped._untouched._pending and not outs[2]._backward_hooks
    assert wrapped._untouched.excess                  # the last step was read


def test_a_dropped_call_forgets_its_warm_up_and_readings(monkeypatch):
    device = FakeDevice(monkeypatch)
    wrapped = sn.wrap(_net(), budget=ROOMY)
    _train(wrapped, [0, 0], device)
    assert wrapped._untouched.excess and wrapped._untouched.warmups
    copied = copy.deepcopy(wrapped)                    # hooks and readings do not travel
    assert not copied._untouched.excess and not copied._untouched.warmups
    wrapped.replan()
    assert not wrapped._untouched.excess and not wrapped._untouched.warmups


def test_a_step_in_flight_when_its_plan_is_dropped_is_not_read(monkeypatch):
    device = FakeDevice(monkeypatch)
    wrapped = sn.wrap(_net(), budget=ROOMY)
    _train(wrapped, [0], device)                       # the managed warm-up
    device.excess = 10 * LIVENESS
    loss = F.cross_entropy(wrapped(X), Y)              # untouched, watched
    assert wrapped._last[1] is None
    wrapped.replan()
    loss.backward()
    assert not wrapped._untouched.excess


def test_looking_at_the_plan_is_not_the_warm_up(monkeypatch):
    """plan_for() (the command line's look before training) answers as the step would and
    leaves the first step managed."""
    device = FakeDevice(monkeypatch)
    wrapped = sn.wrap(_net(), budget=ROOMY)
    for _ in range(2):
        assert wrapped.plan_for(X)[1] is not None
    assert [u for _, u in _train(wrapped, [0, 0], device)] == [False, True]


def test_a_step_past_the_budget_is_said_once_per_call(monkeypatch):
    """Rule 4: a managed step (here within the margin of liveness) or an untouched one whose
    peak passed the budget warns, once per call; within the budget nothing is said."""
    device = FakeDevice(monkeypatch)
    budget = LIVENESS + LIVENESS // 16
    with pytest.warns(UserWarning, match="over the budget") as record:
        steps = _train(sn.wrap(_net(), budget=budget), [LIVENESS // 8] * 3, device)
    assert [u for _, u in steps] == [False] * 3
    assert sum("over the budget" in str(w.message) for w in record) == 1
    with pytest.warns(UserWarning, match="over the budget") as record:
        steps = _train(sn.wrap(_net(), budget=ROOMY), [0, LIVENESS // 4, LIVENESS // 4], device)
    assert [u for _, u in steps] == [False, True, False]     # the reading turned it managed
    assert sum("over the budget" in str(w.message) for w in record) == 1
    with pytest.warns(UserWarning, match="over the budget"):       # a policy that is not Rule 2's
        _train(sn.wrap(_net(), policy="liveness", budget=ROOMY), [LIVENESS // 4] * 2, device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(sn.wrap(_net(), budget=ROOMY), [0] * 3, device)
        _train(sn.wrap(_net()), [LIVENESS] * 2, device)             # no budget to pass


def test_under_strict_budget_nothing_is_said():
    """Rule 4: the allocator refuses past the budget inside the step; what passes it is the
    caller's (its loss)."""
    cuda = torch.device("cuda")
    assert sn.wrap(_net(), budget=ROOMY)._says_passed(cuda)
    assert not sn.wrap(_net(), budget=ROOMY, strict_budget=True)._says_passed(cuda)


def test_a_managed_step_past_the_budget_raises_its_plans_excess_once(monkeypatch):
    """Rule 5: the executor leaves what a managed step passed the budget by beside its pool
    from the next step on, once per plan; a step within the budget changes nothing."""
    device = FakeDevice(monkeypatch)
    budget = LIVENESS + LIVENESS // 16
    wrapped = sn.wrap(_net(), budget=budget)
    over = LIVENESS // 8 - LIVENESS // 16           # the fake peak less the budget
    _train(wrapped, [0], device)
    calibration = wrapped._last[1].calibration
    calibration.excess_bytes, calibration.seen_excess = calibration.slack, 0   # as calibrated
    calibration.active, calibration.left = False, 0
    with pytest.warns(UserWarning, match="over the budget"):
        _train(wrapped, [LIVENESS // 8], device)
    raised = calibration.excess_bytes
    assert calibration.raised and calibration.seen_excess == over
    assert raised == over + calibration.slack
    assert calibration.left == CALIBRATION_STEPS    # the next steps read the allocator again
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train(wrapped, [LIVENESS // 4], device)    # passed again: not raised twice
    assert calibration.excess_bytes == raised
    fresh = sn.wrap(_net(), budget=budget)
    _train(fresh, [0, 0], device)
    assert not fresh._last[1].calibration.raised
