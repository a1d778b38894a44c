"""The budget as the allocator's limit while a step runs (runtime/allocator_cap.py, module
Rule 8): held through forward and backward, the caller's limit back for the loss and the
optimizer, holders nesting. The CPU cases fake CUDA's limit; the CUDA cases read the real one."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import superneurons as sn
from superneurons.runtime import allocator_cap
from superneurons.runtime.allocator_cap import AllocatorCap
from superneurons import models

GiB = 1 << 30
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (device machine)")
pytestmark = pytest.mark.skipif(not hasattr(torch.cuda, "get_per_process_memory_fraction"),
                                reason="this torch cannot read the allocator's limit")


class FakeLimit:
    """CUDA's per-process fraction and device size, on a machine without CUDA."""

    def __init__(self, monkeypatch, total=80 * GiB, fraction=1.0):
        self.total, self.fraction, self.sets = total, fraction, 0
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda index: type("Properties", (), {"total_memory": total}))
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction",
                            lambda index=None: self.fraction)
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", self.set)
        monkeypatch.setattr(allocator_cap, "_held", {})
        monkeypatch.setattr(allocator_cap, "_reserved_bytes", lambda index: 0)

    def set(self, fraction, index=None):
        self.fraction, self.sets = fraction, self.sets + 1

    @property
    def limit_bytes(self) -> int:
        return round(self.fraction * self.total)


CUDA0 = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def _callers_limit_back():
    """A failed CUDA case (a backward that raised keeps the limit: allocator_cap.py) leaves the
    next cases the limit they had."""
    before = torch.cuda.get_per_process_memory_fraction(0) if torch.cuda.is_available() else None
    yield
    if before is not None:
        allocator_cap._held.clear()
        torch.cuda.set_per_process_memory_fraction(before, 0)


def test_holders_nest_and_the_callers_limit_comes_back(monkeypatch):
    limit = FakeLimit(monkeypatch, fraction=0.5)
    loose, strict = AllocatorCap(CUDA0, 60 * GiB), AllocatorCap(CUDA0, 20 * GiB)
    loose.hold()
    assert limit.fraction == 0.5            # the caller's is stricter than 60 GiB: kept
    strict.hold()
    assert limit.limit_bytes == 20 * GiB
    loose.release()
    assert limit.limit_bytes == 20 * GiB    # the strict holder still runs
    strict.release()
    assert limit.fraction == 0.5
    strict.release()                        # a second release changes nothing
    assert limit.fraction == 0.5 and allocator_cap._held == {}


def test_a_cap_is_held_from_the_first_gradient_to_the_end_of_backward(monkeypatch):
    limit = FakeLimit(monkeypatch)
    cap = AllocatorCap(CUDA0, 8 * GiB)
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            seen.append(limit.limit_bytes)
            return grad * 2

    x = torch.ones(3, requires_grad=True)
    out = {"logits": Probe.apply(x), "aux": Probe.apply(x), "count": 3}
    cap.through_backward(out)
    assert limit.fraction == 1.0            # nothing held between forward and backward
    (out["logits"].sum() + out["aux"].sum()).backward()
    assert seen == [8 * GiB, 8 * GiB]
    assert limit.fraction == 1.0 and allocator_cap._held == {}


def test_strict_budget_is_refused_where_it_cannot_hold(monkeypatch):
    with pytest.raises(ValueError, match="give a budget"):
        sn.wrap(nn.Linear(2, 2), strict_budget=True)
    model = sn.wrap(nn.Linear(2, 2), budget="1GiB", strict_budget=True)
    with pytest.raises(ValueError, match="on cpu: leave strict_budget off"):
        model(torch.randn(3, 2, requires_grad=True))
    monkeypatch.delattr(torch.cuda, "get_per_process_memory_fraction")
    with pytest.raises(ValueError, match="cannot read the allocator's limit"):
        sn.wrap(nn.Linear(2, 2), budget="1GiB", strict_budget=True)


def _resnet(device):
    torch.manual_seed(0)
    return models.resnet(blocks=(1, 1, 1, 1), num_classes=10).to(device)


def _others(model: nn.Module, *tensors) -> int:
    """Device bytes neither ``model`` nor ``tensors`` hold: what the budget must leave beside
    the plan (cuBLAS's workspaces, made by the first matrix product, are among them)."""
    own = sum(t.numel() * t.element_size() for t in (*model.parameters(), *tensors))
    return torch.cuda.memory_allocated() - own


@needs_cuda
@pytest.mark.parametrize("policy", ["superneurons", "liveness"])
def test_on_cuda_steps_run_under_the_budget_and_the_optimizer_under_the_callers_limit(policy):
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
    budget += _others(model, x, y)
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
    assert untouched == [policy == "liveness"] * 3


@needs_cuda
@pytest.mark.parametrize("cudnn_benchmark", [False, True])
def test_on_cuda_a_convolution_takes_a_smaller_workspace_under_the_cap(cudnn_benchmark):
    """What the cap is for: without it, a convolution's workspace lifts the step's peak over
    a budget just above the step's tensors; with it, the peak stays within, though cuDNN
    chose (and with benchmark=True cached) its algorithm without the cap first."""
    torch.backends.cudnn.benchmark = cudnn_benchmark
    try:
        conv = nn.Conv2d(256, 256, 3, padding=1).cuda()
        x = torch.randn(64, 256, 56, 56, device="cuda", requires_grad=True)
        budget = sn.plan(conv, x, policy="liveness").peak_bytes + _others(conv, x) + (64 << 20)
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
        torch.backends.cudnn.benchmark = False
