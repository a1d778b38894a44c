"""A convolution of a step that trusts its calibration runs beside no more pool bytes than at its
fit (executor Rule 10): on the CPU with a fake fit and fake copies in flight, on CUDA for real."""

from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

import superneurons as sn
from superneurons.capture.kinds import Kind
from superneurons.runtime import allocator_cap
from superneurons.runtime.executor import Executor
from test_workspaces import _net as workspaces_net

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or not allocator_cap.available(),
    reason="needs CUDA (device machine) and a torch that reads the allocator's limit")


def _net(device):
    return workspaces_net(device, width=128)


class _FakeFit:
    """WorkspaceFit's interface, limiting nothing."""

    @contextmanager
    def fitted(self, output_bytes):
        yield

    def through_backward(self, out, gradient_bytes):
        pass


class _Copy:
    """An offload's event whose copy never ends by itself."""

    def query(self):
        return False

    def synchronize(self):                   # the pool's close waits for what is left
        pass


def test_a_trusting_step_frees_copies_in_flight_down_to_the_pool_of_the_fit():
    x = torch.randn(4, 64, 16, 16)
    liveness = sn.plan(_net("cpu"), x, policy="liveness").peak_bytes
    floor = sn.plan(_net("cpu"), x, policy="offload").peak_bytes
    wrapped = sn.wrap(_net("cpu"), policy="offload", budget=(floor + liveness) // 2)
    wrapped(x).sum().backward()
    executor = wrapped._last[1]
    pool, waited = executor.pool, []
    executor.workspaces = _FakeFit()
    pool.mover.reuse_after = waited.append
    conv = next(layer for layer in executor.graph.layers if layer.kind is Kind.CONV)

    def run(calibrating: bool) -> None:
        executor.calibrating = calibrating
        executor._call(conv, (x,), {}, trains=False)

    run(calibrating=True)
    fitted = executor.fitted_beside[(conv.index, False)]
    assert fitted == pool.device_bytes
    copies = [_Copy() for _ in range(3)]
    for copy in copies:                      # three offloads of 1 MiB each still in flight
        pool.draining.append((copy, torch.empty(1 << 20, dtype=torch.uint8), 1 << 20))
        pool._hold(1 << 20, 1 << 20)
    run(calibrating=False)
    assert waited == copies and pool.device_bytes == fitted and not pool.draining
    assert executor.drained_convolutions == 1
    run(calibrating=False)                   # nothing past the fit's pool: nothing waits
    assert executor.drained_convolutions == 1 and len(waited) == 3
    pool.draining.append((copies[0], torch.empty(1), 1 << 20))
    pool._hold(1 << 20, 1)
    executor.calibration.raised = True       # fitted again at every step (Rule 9): no wait
    run(calibrating=False)
    assert len(waited) == 3 and pool.draining


@needs_cuda
def test_on_cuda_every_trusting_convolution_runs_beside_the_pool_of_its_fit(monkeypatch):
    """Whatever the copies' timing, no convolution of a step after calibration finds the pool
    holding more than at its fit while copies are still in flight."""
    x = torch.randn(64, 64, 56, 56, device="cuda")
    y = torch.randint(0, 10, (64,), device="cuda")
    liveness = sn.plan(_net("cuda"), x, policy="liveness").peak_bytes
    floor = sn.plan(_net("cuda"), x, policy="offload").peak_bytes
    wrapped = sn.wrap(_net("cuda"), policy="offload",
                      budget=(floor + liveness) // 2 + torch.cuda.memory_allocated())
    found = []
    run_layer = Executor._run_layer

    def checked(executor, layer, args, kwargs, trains):
        key = (layer.index, trains)
        if layer.kind is Kind.CONV and key in executor.fitted_beside and \
                not (executor.calibrating or executor.calibration.raised):
            executor.pool.free_finished()
            found.append(executor.pool.device_bytes <= executor.fitted_beside[key]
                         or not executor.pool.draining)
        return run_layer(executor, layer, args, kwargs, trains)
    monkeypatch.setattr(Executor, "_run_layer", checked)
    for _ in range(5):
        F.cross_entropy(wrapped(x), y).backward()
    executor = wrapped._last[1]
    assert executor.workspaces is not None and executor.pool.offloaded_bytes > 0
    assert found and all(found)
