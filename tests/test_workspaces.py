"""Convolution workspaces fitted to the budget while a plan calibrates (runtime/workspaces.py,
executor Rule 9)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import superneurons as sn
from superneurons.runtime import allocator_cap, executor as executor_module
from superneurons.runtime.workspaces import segment_bytes

MiB = 1 << 20
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or not allocator_cap.available(),
    reason="needs CUDA (device machine) and a torch that reads the allocator's limit")


def test_a_request_reserves_at_most_its_allocator_segment():
    assert segment_bytes(1) == 2 * MiB
    assert segment_bytes(MiB) == 2 * MiB
    assert segment_bytes(MiB + 1) == 20 * MiB
    assert segment_bytes(10 * MiB) == 10 * MiB
    assert segment_bytes(11 * MiB + 1) == 12 * MiB


def _net(device):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(64, 256, 3, padding=1), nn.BatchNorm2d(256), nn.ReLU(),
        nn.Conv2d(256, 256, 3, padding=1), nn.BatchNorm2d(256), nn.ReLU(),
        nn.Conv2d(256, 256, 3, padding=1), nn.BatchNorm2d(256), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 10)).to(device)


def test_off_cuda_no_workspace_is_fitted():
    model = _net("cpu")
    x = torch.randn(4, 64, 16, 16)
    liveness = sn.plan(_net("cpu"), x, policy="liveness").peak_bytes
    floor = sn.plan(_net("cpu"), x, policy="superneurons").peak_bytes
    wrapped = sn.wrap(model, budget=(floor + liveness) // 2)
    wrapped(x).sum().backward()
    executor = wrapped._last[1]
    assert executor is not None and executor.workspaces is None


@needs_cuda
def test_on_cuda_a_managed_steps_convolutions_stay_within_the_budget(monkeypatch):
    """Without fitting, cuDNN's engines take workspaces from what the device allows and the
    step passes a budget its tensors fit; fitted while the plan calibrates, every step stays
    within, the steps after calibration included. The unfitted run goes first, so the fitted
    one also drops engines cuDNN kept with workspaces too large."""
    x = torch.randn(64, 64, 56, 56, device="cuda")
    y = torch.randint(0, 10, (64,), device="cuda")
    liveness = sn.plan(_net("cuda"), x, policy="liveness").peak_bytes
    floor = sn.plan(_net("cuda"), x, policy="superneurons").peak_bytes
    peaks, losses = {}, {}
    for fit in (False, True):
        monkeypatch.setattr(executor_module, "workspaces_fit", lambda device, fit=fit: fit)
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
        assert wrapped._last[1] is not None and not wrapped._last[1].calibrating
        del model, wrapped, optimizer
    # the loss's own tensors, outside the model and the budget's others, are the test's
    assert all(peak <= budget + MiB for peak in peaks[True]), (peaks, budget)
    assert losses[True] == pytest.approx(losses[False], rel=1e-3)
    if all(peak <= budget for peak in peaks[False]):
        pytest.skip("cuDNN took no workspace beyond the budget even unfitted: nothing to compare")
