"""An untouched step's real peak against its plan (runtime/untouched.py, module Rule 2): one
that passed its budget between layers makes the next steps of its call run a managed plan
that leaves room for the excess. The CPU cases fake CUDA's reading of device memory."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import superneurons as sn
from superneurons.runtime import module as module_module, untouched


def _net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(8, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


class FakeDevice:
    """Device memory read as on CUDA: nothing the model does not own, and a step peak of the
    untouched plan's prediction plus ``excess``."""

    def __init__(self, monkeypatch, excess: int):
        self.excess, self.predicted = excess, None
        monkeypatch.setattr(module_module, "reads_device_memory", lambda device: True)
        monkeypatch.setattr(module_module, "foreign_bytes", lambda *args, **kwargs: 0)
        monkeypatch.setattr(untouched, "peak_allocated_bytes",
                            lambda device: self.predicted + self.excess)
        watch = untouched.UntouchedWatch.watch

        def watched(watcher, key, out, device, predicted):
            self.predicted = predicted
            watch(watcher, key, out, device, predicted)
        monkeypatch.setattr(untouched.UntouchedWatch, "watch", watched)


def _steps(model, x, y, n=3):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(n):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("excess_share, managed", [(0.5, True), (0.0, False)])
def test_an_untouched_step_that_passed_its_budget_makes_the_next_ones_managed(
        monkeypatch, excess_share, managed):
    x, y = torch.randn(32, 8, 32, 32), torch.randint(0, 10, (32,))
    liveness = sn.plan(_net(), x, policy="liveness").peak_bytes
    floor = sn.plan(_net(), x, policy="superneurons").peak_bytes
    budget = liveness + (liveness - floor) // 4
    FakeDevice(monkeypatch, excess=int(excess_share * (liveness - floor)))
    if not managed:
        monkeypatch.setattr(untouched, "peak_allocated_bytes", lambda device: 0)
    wrapped = sn.wrap(_net(), budget=budget)
    runs = []
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        loss = F.cross_entropy(wrapped(x), y)
        runs.append(wrapped._last[1] is not None)          # the step's executor
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    assert runs == [False, managed, managed]
    if managed:
        assert wrapped._last[0].peak_bytes <= budget - (liveness - floor) // 2
    plain = _steps(_net(), x, y)
    assert all(torch.equal(a, b) for a, b in zip(losses, plain))


def test_an_output_without_a_backward_is_not_watched():
    watch = untouched.UntouchedWatch()
    leaf = torch.ones(3, requires_grad=True)
    watch.watch("key", (leaf, torch.ones(2)), torch.device("cpu"), 0)
    assert leaf._backward_hooks is None or not leaf._backward_hooks


def test_an_excess_no_plan_fits_beside_is_named_in_the_error(monkeypatch):
    x, y = torch.randn(32, 8, 32, 32), torch.randint(0, 10, (32,))
    liveness = sn.plan(_net(), x, policy="liveness").peak_bytes
    floor = sn.plan(_net(), x, policy="superneurons").peak_bytes
    FakeDevice(monkeypatch, excess=liveness)
    wrapped = sn.wrap(_net(), budget=liveness + (liveness - floor) // 4)
    F.cross_entropy(wrapped(x), y).backward()
    with pytest.raises(ValueError, match="its untouched step used beyond its plan"):
        wrapped(x)
