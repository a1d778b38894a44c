"""The budget as the allocator's limit while a step runs (runtime/allocator_cap.py, module
Rule 8): held through forward and backward, the caller's limit back for the loss and the
optimizer, holders nesting. The CPU cases fake CUDA's limit; the CUDA cases read the real one."""

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import superneurons as sn
from superneurons.runtime import allocator_cap, workspaces
from superneurons.runtime.allocator_cap import AllocatorCap
from superneurons import models

GiB = 1 << 30
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or not allocator_cap.available(),
    reason="needs CUDA (device machine) and a torch that reads the allocator's limit")


class FakeLimit:
    """CUDA's per-process fraction and device size, on a machine without CUDA."""

    def __init__(self, monkeypatch, total=80 * GiB, fraction=1.0):
        self.total, self.fraction, self.sets = total, fraction, 0
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda index: type("Properties", (), {"total_memory": total}))
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction",
                            lambda index=None: self.fraction, raising=False)
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", self.set)
        monkeypatch.setattr(allocator_cap, "_held", {})
        monkeypatch.setattr(allocator_cap, "_reserved_bytes", lambda index: 0)

    def set(self, fraction, index=None):
        self.fraction, self.sets = fraction, self.sets + 1

    @property
    def limit_bytes(self) -> int:
        return round(self.fraction * self.total)


CUDA0 = torch.device("cuda", 0)


@pytest.fixture
def expandable_segments():
    """The allocator as the benchmarks run it (expandable segments): with segments fixed in
    size, blocks freed between live ones stay reserved, and a limit at the budget counts them."""
    torch.cuda.empty_cache()
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    yield
    torch.cuda.empty_cache()
    torch.cuda.memory._set_allocator_settings("expandable_segments:False")


@pytest.fixture(autouse=True)
def _callers_limit_back():
    """A failed CUDA case leaves the next ones the limit they had."""
    cuda = torch.cuda.is_available() and allocator_cap.available()
    before = torch.cuda.get_per_process_memory_fraction(0) if cuda else None
    yield
    if before is not None:
        allocator_cap._held.clear()
        workspaces._running.clear()
        torch.cuda.set_per_process_memory_fraction(before, 0)


class Probe(torch.autograd.Function):
    """Doubles its input; its backward records the fake limit, runs ``during`` and raises
    where ``fail`` says."""
    seen, during, fail = [], None, False

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        Probe.seen.append(Probe.limit.limit_bytes)
        if Probe.during is not None:
            Probe.during()
        if Probe.fail:
            raise RuntimeError("a backward that fails")
        return grad * 2


@pytest.fixture
def probe(monkeypatch):
    Probe.limit = FakeLimit(monkeypatch)
    Probe.seen, Probe.during, Probe.fail = [], None, False
    return Probe


def strict_wrapper(budget):
    return sn.wrap(nn.Linear(2, 2), budget=budget, strict_budget=True)


def test_holders_nest_and_the_callers_limit_comes_back(monkeypatch):
    limit = FakeLimit(monkeypatch, fraction=0.5)
    loose, strict = AllocatorCap(CUDA0, 60 * GiB), AllocatorCap(CUDA0, 20 * GiB)
    first = loose.hold_forward()
    assert limit.fraction == 0.5            # the caller's is stricter than 60 GiB: kept
    second = strict.hold_forward()
    assert limit.limit_bytes == 20 * GiB
    loose.release(first)
    assert limit.limit_bytes == 20 * GiB    # the strict holder still runs
    strict.release(second)
    assert limit.fraction == 0.5
    strict.release(second)                  # a second release changes nothing
    assert limit.fraction == 0.5 and allocator_cap._held == {}


def test_a_cap_is_held_from_the_first_gradient_to_the_end_of_backward(probe):
    wrapped = strict_wrapper(8 * GiB)
    x = torch.ones(3, requires_grad=True)
    out = wrapped._capped(CUDA0, lambda: {"logits": probe.apply(x), "aux": probe.apply(x),
                                          "input": x, "count": 3})
    assert probe.limit.fraction == 1.0      # nothing held between forward and backward
    (out["logits"].sum() + out["aux"].sum()).backward()
    assert probe.seen == [8 * GiB, 8 * GiB]
    assert probe.limit.fraction == 1.0 and allocator_cap._held == {}
    assert not x._backward_hooks            # a leaf returned keeps no hook for later steps


def test_a_forward_that_raises_gives_the_limit_back(probe):
    def fails():
        assert probe.limit.limit_bytes == 8 * GiB
        raise ValueError("the model's own error")
    with pytest.raises(ValueError, match="own error"):
        strict_wrapper(8 * GiB)._capped(CUDA0, fails)
    assert probe.limit.fraction == 1.0 and allocator_cap._held == {}


def test_a_forward_run_inside_the_backward_keeps_the_backwards_limit(probe):
    """A recomputation (torch.utils.checkpoint around the wrapped model) runs its forward
    again inside the backward: its hold ends, the backward's stays."""
    wrapped = strict_wrapper(8 * GiB)
    probe.during = lambda: wrapped._capped(CUDA0, lambda: None)
    x = torch.ones(3, requires_grad=True)
    wrapped._capped(CUDA0, lambda: probe.apply(probe.apply(x))).sum().backward()
    assert probe.seen == [8 * GiB, 8 * GiB]
    assert probe.limit.fraction == 1.0 and allocator_cap._held == {}


def test_a_backward_that_raises_keeps_the_limit_until_the_next_forward_or_collection(probe):
    x = torch.ones(3, requires_grad=True)
    failing = strict_wrapper(8 * GiB)
    probe.fail = True
    with pytest.raises(RuntimeError, match="fails"):
        failing._capped(CUDA0, lambda: probe.apply(x)).sum().backward()
    assert probe.limit.limit_bytes == 8 * GiB          # no callback ran
    probe.fail = False
    strict_wrapper(40 * GiB)._capped(CUDA0, lambda: None)   # another wrapper, a larger budget
    assert probe.limit.fraction == 1.0 and allocator_cap._held == {}

    probe.fail = True
    with pytest.raises(RuntimeError, match="fails"):
        failing._capped(CUDA0, lambda: probe.apply(x)).sum().backward()
    del failing
    gc.collect()
    assert probe.limit.fraction == 1.0 and allocator_cap._held == {}


def test_a_convolution_limit_left_by_a_raising_backward_gives_back_what_remains(
        probe, monkeypatch):
    """The backward raised inside a convolution under its workspace limit, which replaced the
    strict budget's fraction; once that hold is dropped (its wrapper collected), the limit
    left gives back the caller's fraction, not the dropped budget's."""
    monkeypatch.setattr(workspaces, "_running", {})
    x = torch.ones(3, requires_grad=True)
    failing = strict_wrapper(8 * GiB)
    probe.during = lambda: workspaces._running.__setitem__(
        0, workspaces._Running(None, [], probe.limit.fraction))     # a limit begins, then
    probe.fail = True                                                # the backward raises
    with pytest.raises(RuntimeError, match="fails"):
        failing._capped(CUDA0, lambda: probe.apply(x)).sum().backward()
    del failing
    gc.collect()
    workspaces.end_stale()                    # what the next wrapped forward does first
    assert probe.limit.fraction == 1.0 and not workspaces._running


def test_strict_budget_is_refused_where_it_cannot_hold(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda index=None: 1.0,
                        raising=False)
    with pytest.raises(ValueError, match="give a budget"):
        sn.wrap(nn.Linear(2, 2), strict_budget=True)
    model = sn.wrap(nn.Linear(2, 2), budget="1GiB", strict_budget=True)
    with pytest.raises(ValueError, match="on cpu: leave strict_budget off"):
        model(torch.randn(3, 2, requires_grad=True))
    with pytest.raises(ValueError, match="runs on cpu: leave strict_budget off"):
        sn.wrap(nn.Linear(2, 2), budget="1GiB", state="host", device="cpu",
                strict_budget=True)
    monkeypatch.delattr(torch.cuda, "get_per_process_memory_fraction")
    with pytest.raises(ValueError, match="cannot read the allocator's limit"):
        sn.wrap(nn.Linear(2, 2), budget="1GiB", strict_budget=True)


def _resnet(device):
    torch.manual_seed(0)
    return models.resnet(blocks=(1, 1, 1, 1), num_classes=10).to(device)


def _others(model: nn.Module, *tensors) -> int:
    """Device bytes neither ``model`` nor ``tensors`` hold: what the budget must leave beside
    the plan (cuBLAS's workspaces, made by the first matrix product, are among them). Garbage
    is collected first: models planned and dropped may still hold device memory in reference
    cycles, which would count here and then leave during a step."""
    gc.collect()
    own = sum(t.numel() * t.element_size()
              for t in (*model.parameters(), *model.buffers(), *tensors))
    return torch.cuda.memory_allocated() - own


@needs_cuda
@pytest.mark.parametrize("policy", [
    # known (issue 16): at a strict budget between the floor and liveness the managed step runs
    # out of the capped allocator bringing a saved tensor back; not yet diagnosed
    pytest.param("superneurons", marks=pytest.mark.xfail(
        raises=RuntimeError, strict=True, reason="strict managed step out of memory (issue 16)")),
    "liveness"])
def test_on_cuda_steps_run_under_the_budget_and_the_optimizer_under_the_callers_limit(
        policy, expandable_segments):
    """Both paths: a managed plan (superneurons at a budget below liveness) and the untouched
    model (a budget above it). SGD without momentum: no optimizer state grows what the model
    does not own, so each step takes the same path."""
    x = torch.randn(32, 3, 64, 64, device="cuda")
    y = torch.randint(0, 10, (32,), device="cuda")
    liveness = sn.plan(_resnet("cuda"), x, policy="liveness").peak_bytes
    floor = sn.plan(_resnet("cuda"), x, policy="superneurons").peak_bytes
    model = _resnet("cuda")
    F.cross_entropy(model(x), y).backward()          # cuBLAS's workspaces exist from here
    model.zero_grad(set_to_none=True)
    budget = (floor + liveness) // 2 if policy == "superneurons" else 2 * liveness
    budget += _others(model, x)              # y is not the model's: the wrapper counts it
    total = torch.cuda.get_device_properties(0).total_memory
    caller = torch.cuda.get_per_process_memory_fraction(0)
    wrapped = sn.wrap(model, policy="superneurons", budget=budget, strict_budget=True)
    seen = []
    next(model.parameters()).register_hook(
        lambda grad: seen.append(torch.cuda.get_per_process_memory_fraction(0)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    untouched = []
    for _ in range(3):
        optimizer.zero_grad()
        out = wrapped(x)
        untouched.append(wrapped._last[1] is None)                  # the step's executor
        assert torch.cuda.get_per_process_memory_fraction(0) == caller
        F.cross_entropy(out, y).backward()
        assert torch.cuda.get_per_process_memory_fraction(0) == caller
        optimizer.step()
        assert torch.cuda.max_memory_allocated() <= budget
    assert seen == [pytest.approx(min(caller, budget / total))] * 3
    # module Rule 2's warm-up: a call's first step runs managed though liveness fits
    assert untouched == [False] + [policy == "liveness"] * 2


@needs_cuda
@pytest.mark.parametrize("cudnn_benchmark", [False, True])
def test_on_cuda_a_convolution_takes_a_smaller_workspace_under_the_cap(cudnn_benchmark,
                                                                    expandable_segments):
    """What the cap is for: without it, a convolution's workspace lifts the step's peak over
    a budget just above the step's tensors; with it, the peak stays within, though cuDNN
    chose (and with benchmark=True cached) its algorithm without the cap first."""
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = cudnn_benchmark
    try:
        conv = nn.Conv2d(256, 256, 3, padding=1).cuda()
        x = torch.randn(64, 256, 56, 56, device="cuda", requires_grad=True)
        # the loss's gradient reaches the convolution expanded: its backward copies it whole,
        # beyond the plan (which knows the model, not the loss)
        expanded = 64 * 256 * 56 * 56 * 4
        budget = sn.plan(conv, x, policy="liveness").peak_bytes + _others(conv, x) + \
            expanded + (64 << 20)
        peaks = {}
        for strict in (False, True):
            # a large block cached free, as a step before this one can leave it
            torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
            wrapped = sn.wrap(conv, policy="liveness", budget=budget, strict_budget=strict)
            wrapped(x).sum().backward()
            peaks[strict] = torch.cuda.max_memory_allocated()
            x.grad = None
        assert peaks[True] <= budget
        if peaks[False] <= budget:
            pytest.skip("cuDNN took no workspace beyond the budget even without the limit: "
                        "nothing to compare")
    finally:
        torch.backends.cudnn.benchmark = before
