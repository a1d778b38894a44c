"""A step whose caching allocator reached its limit and returned its free memory to go on
(runtime/near_limit.py, untouched.py Rule 6): counted in the step's stats and said once per
call. The CPU case fakes the allocator's count; the CUDA case makes a real retry."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import superneurons as sn
from superneurons.runtime import module, untouched
from superneurons.runtime.near_limit import advice, said

GiB, MiB = 1 << 30, 1 << 20


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _step(wrapped, optimizer, x, y, during_forward=lambda: None) -> list:
    """One SGD step; the warnings it gave. ``during_forward`` runs after the forward (inside
    the step: the allocator's count is read from the forward to the end of backward)."""
    optimizer.zero_grad()
    with warnings.catch_warnings(record=True) as given:
        warnings.simplefilter("always")
        out = wrapped(x)
        during_forward()
        F.cross_entropy(out, y).backward()
    optimizer.step()
    return [str(w.message) for w in given]


def test_a_step_whose_allocator_retried_is_counted_and_said_once_per_call(monkeypatch):
    retries = _faked(monkeypatch)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    tight = sn.plan(_net(), x, policy="superneurons").peak_bytes     # below liveness: managed
    for budget, managed in ((1 << 30, [True, False, False, False]), (tight, [True] * 4)):
        wrapped = sn.wrap(_net(), budget=budget)
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        told, ran = [], []
        for bump in (0, 2, 1, 0):
            given = _step(wrapped, optimizer, x, y,
                          lambda: retries.__setitem__(0, retries[0] + bump))
            told.append([m for m in given if m.startswith("retried")])
            ran.append(wrapped._last[1] is not None)
            assert wrapped.stats.allocator_retries == bump
        assert told == [[], ["retried 2"], [], []]
        assert ran == managed                   # both kinds of step are read


def _faked(monkeypatch, peak=1):
    """CUDA's readings faked on the CPU: the step's peak and the allocator's retries (a list
    whose one item the test moves); the message names the retries only."""
    retries = [0]
    monkeypatch.setattr(module, "reads_device_memory", lambda device: True)
    monkeypatch.setattr(module, "foreign_bytes", lambda *args, **kwargs: 0)
    monkeypatch.setattr(untouched, "peak_allocated_bytes", lambda device: peak)
    monkeypatch.setattr(untouched, "allocator_retries", lambda device: retries[0])
    monkeypatch.setattr(untouched, "message", lambda device, n, budget: f"retried {n}")
    return retries


def test_retries_are_said_after_a_pass_and_across_another_wrappers_reset(monkeypatch):
    """Rule 6 is its own: a call already said past its budget (Rule 4) is still read for
    retries, and a reset of the peak statistic by another wrapper inside the step (Rule 3
    drops that peak) moves no count; a count reset below the step's start reads 0."""
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    liveness = sn.plan(_net(), x, policy="liveness").peak_bytes
    retries = _faked(monkeypatch, peak=2 * liveness)          # every step past the budget
    wrapped = sn.wrap(_net(), policy="liveness", budget=liveness + liveness // 2)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    first = _step(wrapped, optimizer, x, y)
    assert any("over the budget" in m for m in first)
    assert not any(m.startswith("retried") for m in first)

    def another_wrappers_reset_after_retries():
        retries[0] += 3
        untouched.reset_peak(torch.device("cpu"))
    second = _step(wrapped, optimizer, x, y, another_wrappers_reset_after_retries)
    assert [m for m in second if m.startswith("retried")] == ["retried 3"]
    retries[0] = 0                    # the caller reset the allocator's counts
    assert wrapped.stats.allocator_retries == 0


def test_retries_under_the_runtimes_own_workspace_limit_are_not_the_devices(monkeypatch):
    """A workspace refused under executor Rule 9's limit counts as the allocator's retry;
    near_limit leaves those out, forward and backward, and counts those while a backward
    convolution's limit is lifted (its saved tensors coming back under the caller's)."""
    from superneurons.runtime import near_limit
    from superneurons.runtime.workspaces import WorkspaceFit
    from test_workspaces import FakeAllocator
    fake = FakeAllocator(monkeypatch, allocated=GiB, reserved=GiB)
    cuda = torch.device("cuda", 0)
    fit = WorkspaceFit(cuda, budget_bytes=2 * GiB, slack_bytes=0)
    with fit.fitted([MiB]):
        fake.retries += 4                              # workspaces refused under the limit
    assert near_limit.allocator_retries(cuda) == 0
    fake.retries += 1                                  # the device's limit, outside any fit
    assert near_limit.allocator_retries(cuda) == 1
    fit._backward_begins([MiB])
    fake.retries += 2
    assert near_limit.allocator_retries(cuda) == 1     # under the limit now in force
    with fit.lifted():
        fake.retries += 5                              # the caller's limit: the device's
    fake.retries += 6
    workspaces_end(fit)
    assert near_limit.allocator_retries(cuda) == 6


def workspaces_end(fit) -> None:
    """The backward convolution's node ended (its hook)."""
    from superneurons.runtime import workspaces
    workspaces._end(fit.index)


def test_the_message_says_what_budget_leaves_the_allocator_its_overhead():
    text = said("cuda:0", 3, int(11.5 * GiB), 12 * GiB, 11 * GiB, 12 * GiB)
    assert "limit of 12.00 GiB 3 time(s)" in text
    assert "waiting for the device each time, which slows the step" in text
    assert "reserved 12.00 GiB for 11.00 GiB allocated" in text
    assert "lower the budget to 11.00 GiB or less" in text
    # the overhead fits between budget and limit: the room went to memory beside the plan
    text = said("cuda:0", 1, 11 * GiB, 12 * GiB, int(11.8 * GiB), 12 * GiB)
    assert "memory beside the plan" in text and "lower the budget to" not in text


class Spike(nn.Module):
    """A forward whose temporary is twice its input, none of it kept for backward."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(1024, 4)

    def forward(self, x):
        return self.head(x.repeat(2, 1).sum(0, keepdim=True)).expand(len(x), 4)


@pytest.mark.skipif(not torch.cuda.is_available() or
                    not hasattr(torch.cuda, "get_per_process_memory_fraction"),
                    reason="needs CUDA (device machine) and a torch that reads the limit")
@pytest.mark.parametrize("expandable", [False, True])
def test_on_cuda_a_real_retry_is_counted_and_said(expandable):
    """A 300 MiB block held free behind a live one, a limit 350 MiB above what is reserved,
    and a step whose forward asks for 400 MiB: the allocator returns the free block and tries
    again."""
    torch.cuda.empty_cache()
    torch.cuda.memory._set_allocator_settings(f"expandable_segments:{expandable}")
    before = torch.cuda.get_per_process_memory_fraction(0)
    try:
        x = torch.randn(200 * MiB // 4096, 1024, device="cuda")          # 200 MiB
        y = torch.randint(0, 4, (len(x),), device="cuda")
        wrapped = sn.wrap(Spike().cuda(), budget="4GiB")
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        first = _step(wrapped, optimizer, x, y)             # plans, measures the device
        assert not [m for m in first if "limit of" in m]
        assert wrapped.stats.allocator_retries == 0
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        held_free = torch.empty(300 * MiB, dtype=torch.uint8, device="cuda")
        live = torch.empty(10 * MiB, dtype=torch.uint8, device="cuda")     # noqa: F841
        del held_free
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(
            (torch.cuda.memory_reserved() + 350 * MiB) / total, 0)
        second = _step(wrapped, optimizer, x, y)
        assert wrapped.stats.allocator_retries >= 1
        assert len([m for m in second if "reached its limit" in m]) == 1
    finally:
        torch.cuda.set_per_process_memory_fraction(before, 0)
        torch.cuda.empty_cache()
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")


def test_the_advice_names_a_budget_that_leaves_the_allocator_its_overhead():
    """near_limit.advice: the limit less what the allocator held beyond the tensors; where the
    budget is below that already, the room went to memory beside the plan."""
    gib = 2**30
    assert "lower the budget to 10.00 GiB" in advice(int(11.5 * gib), 11 * gib, 9 * gib, 12 * gib)
    assert "give a budget of 10.00 GiB" in advice(None, 11 * gib, 9 * gib, 12 * gib)
    assert "memory beside the plan" in advice(5 * gib, 11 * gib, 9 * gib, 12 * gib)
