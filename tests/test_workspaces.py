"""Convolution workspaces fitted to the budget at every step (runtime/workspaces.py, executor
Rule 9)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import superneurons as sn
from torch.autograd.graph import saved_tensors_hooks

from superneurons.runtime import allocator_cap, executor as executor_module, near_limit, workspaces
from superneurons.runtime.workspaces import WorkspaceFit, grad_bytes, segment_bytes

MiB, GiB = 1 << 20, 1 << 30
CUDA0 = torch.device("cuda", 0)
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or not allocator_cap.available(),
    reason="needs CUDA (device machine) and a torch that reads the allocator's limit")


def test_a_request_reserves_at_most_its_allocator_segment():
    """Fixed segments: 2 MiB up to 1 MiB, 20 MiB below 10, 2 MiB pages above; expandable
    ones grow by 20 MiB: the larger of the two."""
    assert segment_bytes(1) == 2 * MiB
    assert segment_bytes(MiB) == 2 * MiB
    assert segment_bytes(MiB + 1) == 20 * MiB
    assert segment_bytes(10 * MiB) == 20 * MiB
    assert segment_bytes(21 * MiB) == 40 * MiB


class FakeAllocator:
    """CUDA's allocator as the fit reads and limits it, on a machine without CUDA: what is
    allocated and reserved, its count of retries, the per-process fraction of an 80 GiB device,
    empty_cache (which leaves a 2 MiB sliver of every partly used page)."""

    def __init__(self, monkeypatch, allocated, reserved, fraction=1.0, total=80 * GiB):
        self.allocated, self.reserved, self.fraction, self.total = allocated, reserved, \
            fraction, total
        self.emptied, self.limits, self.retries = 0, [], 0
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda index: type("Properties", (), {"total_memory": total}))
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction",
                            lambda index=None: self.fraction, raising=False)
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", self.set)
        monkeypatch.setattr(torch.cuda, "empty_cache", self.empty)
        monkeypatch.setattr(workspaces, "_stats",
                            lambda index: (self.allocated, self.reserved, self.retries))
        monkeypatch.setattr(near_limit, "counted", lambda index: self.retries)
        monkeypatch.setattr(near_limit, "_own", {})
        monkeypatch.setattr(near_limit, "_began", {})

    def set(self, fraction, index=None):
        self.fraction = fraction
        self.limits.append(round(fraction * self.total))

    def empty(self):
        self.emptied += 1
        self.reserved = self.allocated + 2 * MiB

    @property
    def limit(self) -> int:
        return round(self.fraction * self.total)


@pytest.mark.parametrize("outputs", [MiB, 256 * MiB, 600 * MiB])
def test_a_workspace_gets_the_room_the_budget_leaves_beside_the_outputs(monkeypatch, outputs):
    """The outputs are allocated under the limit too, so with room the limit is the budget less
    the slack whatever they are: counted in the room and again in the limit, a workspace would
    get the room less their bytes."""
    fake = FakeAllocator(monkeypatch, allocated=GiB, reserved=GiB + 8 * MiB)
    fit = WorkspaceFit(CUDA0, budget_bytes=2 * GiB, slack_bytes=16 * MiB)
    with fit.fitted([outputs]):
        # the 8 MiB cached free are part of the room: a workspace may take them
        assert fake.limit == pytest.approx(2 * GiB - 16 * MiB, abs=1)
    assert fake.fraction == 1.0                     # the caller's limit is back
    assert fake.emptied == 0                        # 8 MiB cached free: less than the room


def test_without_room_the_outputs_still_fit_and_cached_blocks_are_returned(monkeypatch):
    fake = FakeAllocator(monkeypatch, allocated=2 * GiB - 100 * MiB, reserved=3 * GiB)
    fit = WorkspaceFit(CUDA0, budget_bytes=2 * GiB, slack_bytes=0)
    with fit.fitted([256 * MiB]):
        assert fake.emptied == 1                    # a cached GiB would serve any workspace
        # and one small segment for the kernel's own small requests
        assert fake.limit == pytest.approx(
            fake.reserved + segment_bytes(256 * MiB) + segment_bytes(1), abs=1)


def test_a_stricter_limit_of_the_callers_stays(monkeypatch):
    fake = FakeAllocator(monkeypatch, allocated=GiB, reserved=GiB, fraction=0.0125)   # 1 GiB
    fit = WorkspaceFit(CUDA0, budget_bytes=8 * GiB, slack_bytes=0)
    with fit.fitted([MiB]):
        assert fake.fraction == 0.0125
    assert fake.fraction == 0.0125


def test_a_backward_convolution_runs_limited_and_brings_its_saved_tensors_back_unlimited(
        monkeypatch):
    """Its prehook limits, the executor's unpack lifts the limit while a saved tensor comes
    back and limits again from what is then allocated, its hook gives the caller's back."""
    fake = FakeAllocator(monkeypatch, allocated=GiB, reserved=GiB)
    monkeypatch.setattr(workspaces, "_running", {})
    fit = WorkspaceFit(CUDA0, budget_bytes=2 * GiB, slack_bytes=0)
    conv = nn.Conv2d(3, 4, 3)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    seen = []

    def unpack(tensor):
        seen.append(("unpacking", fit.limiting, fake.fraction < 1.0))
        with fit.lifted():
            seen.append(("lifted", fake.fraction))
            fake.allocated += 64 * MiB              # the pool brings it back
            fake.reserved += 64 * MiB
        seen.append(("limited again", fake.limit))
        return tensor
    with saved_tensors_hooks(lambda tensor: tensor, unpack):
        out = conv(x)
    gradients = grad_bytes([x, conv.weight, conv.bias])
    fit.through_backward(out, gradients)
    out.sum().backward()          # an expanded gradient reaches it: cuDNN copies it, counted
    assert seen[:2] == [("unpacking", True, True), ("lifted", 1.0)]
    # the budget, or what is reserved then plus the segments of its four results (the
    # gradients of x, weight and bias, and cuDNN's copy) and one small segment
    assert seen[-1] == ("limited again", pytest.approx(
        max(2 * GiB, fake.reserved + 5 * segment_bytes(1)), abs=1))
    assert fake.fraction == 1.0 and not fit.limiting


def test_a_hold_that_ends_while_a_convolution_brings_its_tensors_back_keeps_its_limit(
        monkeypatch):
    """A strict budget's hold ending inside lifted() (another wrapper collected) rebases what
    the limit gives back; the convolution then runs under its own limit again."""
    monkeypatch.setattr(workspaces, "_running", {})
    fake = FakeAllocator(monkeypatch, allocated=GiB, reserved=GiB, fraction=4 / 80)
    fit = WorkspaceFit(CUDA0, budget_bytes=2 * GiB, slack_bytes=0)
    fit._backward_begins([256 * MiB])
    limited = fake.limit
    with fit.lifted():
        allocator_cap._apply(0, 3 / 80)
    assert fake.limit == pytest.approx(limited, abs=1)
    workspaces._end(0)
    assert fake.fraction == 3 / 80                 # the fraction of the holds that remain


@pytest.mark.parametrize("kernel, gradient, copied", [
    (3, "as the output", False), (3, "contiguous", True), (3, "expanded", True),
    (8, "flattened", False)])       # a 1x1 output: dense in both layouts, strides aside
def test_the_copy_of_the_gradient_reaching_a_convolution_counts_only_where_it_is_made(
        monkeypatch, kernel, gradient, copied):
    """A gradient dense in the memory format of the convolution's output (channels-last here)
    is read as it is; another (a sum's expanded one, a contiguous one) is copied in that format
    first. A copy counted where none is made would take the limit's room."""
    FakeAllocator(monkeypatch, allocated=GiB, reserved=GiB)
    monkeypatch.setattr(workspaces, "_running", {})
    fit = WorkspaceFit(CUDA0, budget_bytes=2 * GiB, slack_bytes=0)
    begun = []
    monkeypatch.setattr(fit, "_backward_begins", begun.append)
    conv = nn.Conv2d(3, 4, kernel).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 8, 8, requires_grad=True).contiguous(memory_format=torch.channels_last)
    out = conv(x)
    gradients = grad_bytes([x, conv.weight, conv.bias])
    fit.through_backward(out, gradients)
    grad = {"as the output": lambda: torch.ones_like(out),
            "contiguous": lambda: torch.ones(out.shape),
            "expanded": lambda: torch.ones(()).expand(out.shape),
            "flattened": lambda: torch.ones(2, 4).view(2, 4, 1, 1)}[gradient]()
    out.backward(grad)
    copy = [out.numel() * out.element_size()] if copied else []
    assert begun == [gradients + copy]


def test_only_a_convolutions_backward_is_limited(monkeypatch):
    fake = FakeAllocator(monkeypatch, allocated=GiB, reserved=GiB)
    fit = WorkspaceFit(CUDA0, budget_bytes=2 * GiB, slack_bytes=0)
    linear = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    out = linear(x)
    fit.through_backward(out, grad_bytes([x, linear.weight, linear.bias]))
    out.sum().backward()
    assert fake.limits == []


def test_a_backward_that_raised_gives_the_callers_limit_back(monkeypatch):
    """At the next backward convolution, or the next forward outside any backward."""
    fake = FakeAllocator(monkeypatch, allocated=GiB, reserved=GiB)
    monkeypatch.setattr(workspaces, "_running", {})
    fit = WorkspaceFit(CUDA0, budget_bytes=2 * GiB, slack_bytes=0)
    fit._backward_begins([MiB])                     # its node raised: no hook ran
    fit._backward_begins([MiB])
    assert workspaces._running[0].caller == 1.0      # the caller's, not the first limit
    assert fake.fraction < 1.0
    workspaces.end_stale()
    assert fake.fraction == 1.0 and not fit.limiting


def _net(device, width: int = 256):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(64, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
        nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
        nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10)).to(device)


def _managed_on_cpu():
    """The net wrapped at a budget between its floor and liveness, after one step."""
    model = _net("cpu")
    x = torch.randn(4, 64, 16, 16)
    liveness = sn.plan(_net("cpu"), x, policy="liveness").peak_bytes
    floor = sn.plan(_net("cpu"), x, policy="superneurons").peak_bytes
    wrapped = sn.wrap(model, budget=(floor + liveness) // 2)
    wrapped(x).sum().backward()
    return model, wrapped, wrapped._last[1], x


def test_off_cuda_no_workspace_is_fitted():
    executor = _managed_on_cpu()[2]
    assert executor is not None and executor.workspaces is None


@needs_cuda
def test_on_cuda_a_managed_steps_convolutions_stay_within_the_budget(monkeypatch):
    """Without fitting, cuDNN's engines take workspaces from what the device allows and the
    step passes a budget its tensors fit; fitted, every step stays within, the steps after
    calibration included. The unfitted run goes first, so the fitted
    one also drops engines cuDNN kept with workspaces too large."""
    x = torch.randn(64, 64, 56, 56, device="cuda")
    y = torch.randint(0, 10, (64,), device="cuda")
    liveness = sn.plan(_net("cuda"), x, policy="liveness").peak_bytes
    floor = sn.plan(_net("cuda"), x, policy="superneurons").peak_bytes
    peaks, losses = {}, {}
    caller = torch.cuda.get_per_process_memory_fraction(0)
    for fit in (False, True):
        monkeypatch.setattr(executor_module, "fits_on", lambda device, fit=fit: fit)
        model = _net("cuda")
        F.cross_entropy(model(x), y).backward()          # cuBLAS's workspaces exist from here
        model.zero_grad(set_to_none=True)
        own = sum(t.numel() * t.element_size() for t in (*model.parameters(), x))
        budget = (floor + liveness) // 2 + torch.cuda.memory_allocated() - own
        wrapped = sn.wrap(model, budget=budget)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        peaks[fit], losses[fit] = [], []
        for _ in range(4):
            torch.empty(4 << 30, dtype=torch.uint8, device="cuda")   # cached free, as a
            torch.cuda.reset_peak_memory_stats()                     # step before can leave
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(wrapped(x), y)
            loss.backward()
            optimizer.step()
            peaks[fit].append(torch.cuda.max_memory_allocated())
            losses[fit].append(loss.item())
        calibration = wrapped._last[1].calibration
        # calibrating again follows only a step past the budget (untouched.py Rule 5): the
        # unfitted run's, or the loss's own bytes beside a fitted step
        assert not wrapped._last[1].calibrating or calibration.raised
        assert torch.cuda.get_per_process_memory_fraction(0) == caller
        del model, wrapped, optimizer
    # the loss's own tensors, outside the model and the budget's others, are the test's
    assert all(peak <= budget + MiB for peak in peaks[True]), (peaks, budget)
    assert losses[True] == pytest.approx(losses[False], rel=1e-3)
    if all(peak <= budget for peak in peaks[False]):
        pytest.skip("cuDNN took no workspace beyond the budget even unfitted: nothing to compare")


@needs_cuda
def test_on_cuda_under_deterministic_kernels_a_managed_step_is_not_fitted_and_trains_as_plain(
        monkeypatch):
    """Engines chosen within a fitted workspace may round otherwise than plain PyTorch's (on the
    H200 resnet18 parted from plain at its third step): a caller who asked for deterministic
    kernels gets plain's engines, unfitted, and plain's bits."""
    import torchvision
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).cuda()
    x, y = torch.randn(32, 3, 64, 64, device="cuda"), torch.randint(0, 10, (32,), device="cuda")
    state = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = (sn.plan(model, x, policy="superneurons").peak_bytes
              + sn.plan(model, x, policy="liveness").peak_bytes) // 2 + 3 * state
    plain = copy.deepcopy(model)
    wrapped = sn.wrap(model, budget=budget)
    for run, net in ((plain, plain), (wrapped, model)):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        for _ in range(4):
            optimizer.zero_grad()
            F.cross_entropy(run(x), y).backward()
            optimizer.step()
        del optimizer
        plain.zero_grad(set_to_none=True)
        plain.cpu()                  # not in the wrapped model's budget as memory it does not own
    planned = (*wrapped._executors.values(), *wrapped._fallbacks.values())
    executors = [e for _, e in planned if e is not None]
    assert executors and all(e.workspaces is None for e in executors)
    assert any(e.plan.policy.recomputes for e in executors)          # a managed plan ran
    assert all(torch.equal(a, b.cpu()) for a, b in zip(plain.state_dict().values(),
                                                         model.state_dict().values()))


@pytest.mark.parametrize("ask", ["cudnn", "torch"])
def test_deterministic_kernels_leave_workspaces_unfitted_and_strict_budget_refused(
        monkeypatch, ask):
    """Both ways of asking for reproducible kernels turn the fit off (executor Rule 9), and
    strict_budget, which limits every workspace, is refused before its step runs."""
    monkeypatch.setattr(workspaces, "fraction_readable", lambda: True)
    assert workspaces.fits_on(CUDA0)
    if ask == "cudnn":
        monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    else:
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert not workspaces.fits_on(CUDA0)
    ran = []
    with pytest.raises(ValueError, match="deterministic kernels"):
        allocator_cap.capped({}, CUDA0, GiB, lambda: ran.append(1))
    assert not ran


def test_a_forward_inside_a_backward_leaves_the_running_convolutions_limit(monkeypatch):
    """A recomputation runs forwards inside a backward: the limit there is not stale."""
    fake = FakeAllocator(monkeypatch, allocated=GiB, reserved=GiB)
    monkeypatch.setattr(workspaces, "_running", {})
    fit = WorkspaceFit(CUDA0, budget_bytes=2 * GiB, slack_bytes=0)
    x = torch.randn(3, requires_grad=True)
    kept = []

    def during_backward(grad):
        fit._backward_begins([MiB])
        workspaces.end_stale()
        kept.append(fit.limiting)
        workspaces._end(0)
        return grad
    y = x * 2
    y.register_hook(during_backward)
    y.sum().backward()
    assert kept == [True] and fake.fraction == 1.0


def _fitting_executor(monkeypatch, calibrating: bool = True):
    """A managed CPU executor made to fit as a CUDA one would, on a fake allocator: the CPU
    runs the executor's Rule 9 paths."""
    model, wrapped, executor, x = _managed_on_cpu()
    fake = FakeAllocator(monkeypatch, allocated=GiB, reserved=GiB)
    monkeypatch.setattr(workspaces, "_running", {})
    executor.workspaces = WorkspaceFit(CUDA0, budget_bytes=2 * GiB, slack_bytes=0)
    executor.calibrating = calibrating
    monkeypatch.setattr(executor.calibration, "read", lambda: 0)     # no CUDA statistics
    return model, wrapped, executor, fake, x


def test_a_step_that_trusts_its_calibration_fits_its_convolutions_once_one_passed(monkeypatch):
    """Fitted only while calibrating, later steps of ResNet-101 at batch 896 passed the
    budget (executor Rule 9): after a pass every step is fitted; before, a trusting step runs
    the engines kept, at no cost."""
    model, wrapped, executor, fake, x = _fitting_executor(monkeypatch, calibrating=False)
    convs = sum(isinstance(m, nn.Conv2d) for m in model)
    wrapped(x).sum().backward()
    assert fake.limits == []
    executor.calibration.raised = True
    wrapped(x).sum().backward()
    assert len(fake.limits) > 2 * convs and fake.fraction == 1.0    # forward and backward


def test_a_convolution_modules_backward_counts_its_parameters_gradients(monkeypatch):
    """nn.Conv2d is called with its input alone: its weight's and bias's gradients are counted
    all the same."""
    model, wrapped, executor, fake, x = _fitting_executor(monkeypatch)
    given = []
    through = WorkspaceFit.through_backward

    def recorded(self, out, nbytes):
        given.append(nbytes)
        through(self, out, nbytes)
    monkeypatch.setattr(WorkspaceFit, "through_backward", recorded)
    wrapped(x).sum().backward()
    convs = [m for m in model if isinstance(m, nn.Conv2d)]
    activation = 4 * 256 * 16 * 16 * 4                      # each convolution's output, fp32
    expected = [[conv.weight.numel() * 4, conv.bias.numel() * 4] for conv in convs]
    for nbytes in expected[1:]:
        nbytes.insert(0, activation)            # the input's gradient, from the second on
    assert given == expected          # the copy of the gradient reaching it: at its backward
    assert fake.fraction == 1.0 and len(fake.limits) > 2 * len(convs)


def test_a_convolution_out_of_memory_under_its_limit_runs_again_unfitted(monkeypatch):
    """Rule 5's retry, without the limit, and without calibrating again: the limit failed,
    not the plan."""
    model, wrapped, executor, fake, x = _fitting_executor(monkeypatch)
    calls = []

    def fitted_that_fails(self, output_bytes):
        calls.append(output_bytes)
        raise torch.OutOfMemoryError("under the limit")
    monkeypatch.setattr(WorkspaceFit, "fitted", fitted_that_fails)
    left = executor.calibration.left
    expected = model(x).sum()
    out = wrapped(x).sum()
    out.backward()
    assert calls and torch.allclose(out, expected)
    assert executor.calibration.left == left and not executor.unfitted


def test_a_wrapped_forward_gives_back_a_limit_a_raising_backward_left(monkeypatch):
    """Whichever path the next step takes (here an untouched one, a budget liveness fits)."""
    fake = FakeAllocator(monkeypatch, allocated=GiB, reserved=GiB)
    monkeypatch.setattr(workspaces, "_running", {})
    fit = WorkspaceFit(CUDA0, budget_bytes=2 * GiB, slack_bytes=0)
    fit._backward_begins([MiB])                     # its node raised: no hook ran
    assert fake.fraction < 1.0
    x = torch.randn(4, 64, 16, 16)
    liveness = sn.plan(_net("cpu"), x, policy="liveness").peak_bytes
    wrapped = sn.wrap(_net("cpu"), budget=4 * liveness)
    wrapped(x)
    assert fake.fraction == 1.0 and not fit.limiting
