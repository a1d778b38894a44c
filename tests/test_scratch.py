"""A layer's scratch (capture/scratch.py) and the one-step LRN (models/layers.py)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import superneurons as sn
from superneurons.capture import capture
from superneurons.capture.scratch import LiveBytes
from superneurons.models import layers
from superneurons.models.layers import LocalResponseNorm

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (device machine)")
SHAPE = (8, 16, 10, 10)
UNIT = 8 * 16 * 10 * 10 * 4               # bytes of one float32 tensor of SHAPE


class Temporaries(nn.Module):
    """A user's layer whose forward makes two temporaries it does not keep."""

    def forward(self, x):
        return ((x * 2) + 1).sum(dim=1, keepdim=True)


def _lrn_layer(lrn):
    plan = sn.plan(nn.Sequential(nn.Conv2d(16, 16, 1), lrn), SHAPE, "liveness")
    return plan.graph.layers[1], plan.costs.forward[1] / UNIT, plan.costs.backward[1] / UNIT


def test_pytorch_lrn_backward_scratch_counts_in_l_b():
    layer, l_f, l_b = _lrn_layer(nn.LocalResponseNorm(5))
    # saved: the input and three intermediates (internal); backward scratch: 3 units above the
    # gradients in and out
    assert layer.backward_scratch == 3 * UNIT
    assert layer.forward_scratch == 0
    assert l_b == pytest.approx(1 + layer.internal_saved_bytes / UNIT + 1 + 1 + 3)


def test_one_step_lrn_needs_little_over_half(monkeypatch):
    monkeypatch.setattr(layers, "CHUNK_BYTES", UNIT // 8)       # slices of one sample
    ours, l_f, l_b = _lrn_layer(LocalResponseNorm(5))
    _, torch_l_f, torch_l_b = _lrn_layer(nn.LocalResponseNorm(5))
    # forward: x, D and y, with a slice's square and mean; backward: x, D, g and dx, with a
    # slice's scale and mean
    assert (l_f, l_b) == (3 + 2 / 8, 4 + 2 / 8)
    assert l_b <= torch_l_b * 0.5 and l_f < torch_l_f
    assert ours.kind is sn.capture.Kind.LRN


def test_user_layer_forward_temporaries_are_scratch():
    plan = sn.plan(nn.Sequential(nn.Conv2d(16, 16, 1), Temporaries()), SHAPE, "liveness")
    layer = plan.graph.layers[1]
    output = 8 * 1 * 10 * 10 * 4
    assert layer.forward_scratch == 2 * UNIT - output       # x * 2 and + 1, less the output
    assert "scratch" in plan.live_at(1)


def test_fused_layers_have_no_scratch():
    graph = capture(sn.models.build("resnet50"), (2, 3, 64, 64))
    assert all(l.forward_scratch == 0 and l.backward_scratch == 0 for l in graph.layers)


@pytest.mark.parametrize("slice_bytes", [2**30, 1], ids=["whole-batch", "sample-by-sample"])
@pytest.mark.parametrize("size", [1, 2, 4, 5])
@pytest.mark.parametrize("shape", [(3, 6, 9), (2, 7, 5, 6), (2, 8, 3, 4, 5)])
def test_one_step_lrn_is_pytorchs_lrn(size, shape, slice_bytes, monkeypatch):
    monkeypatch.setattr(layers, "CHUNK_BYTES", slice_bytes)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(shape, dtype=torch.float64)
    theirs = F.local_response_norm(x, size, 1e-2, 0.75, 1.5)
    ours = LocalResponseNorm(size, 1e-2, 0.75, 1.5)(x)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(torch.autograd.grad(ours, x, grad)[0],
                               torch.autograd.grad(theirs, x, grad)[0])


def test_one_step_lrn_gradcheck_and_bad_input(monkeypatch):
    monkeypatch.setattr(layers, "CHUNK_BYTES", 1)
    x = torch.randn(3, 6, 3, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(LocalResponseNorm(3, 0.5, 0.75, 1.0), (x,))
    with pytest.raises(ValueError, match="3 or more dimensions"):
        LocalResponseNorm(3)(torch.randn(4, 6))


def _peaks(layer, device: str) -> tuple:
    """(forward, backward) peak bytes a layer adds, on ``device``: by the CUDA allocator, or on
    meta by LiveBytes, the way capture measures. Backward receives its gradient from a product
    (freed once used), as in a network."""
    x = torch.randn(SHAPE, device=device, requires_grad=True)
    if device == "meta":
        watch = LiveBytes()
        with watch:
            y = layer(x)
        forward = watch.peak
        z = y * 2.0
        with watch:
            start = watch.restart_peak()
            (z.backward(torch.ones((), device=device).expand_as(z)))
        return forward, watch.peak - start
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = layer(x)
    forward = torch.cuda.max_memory_allocated() - base
    z = y * 2.0
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    z.backward(torch.ones((), device=device).expand_as(z))
    return forward, torch.cuda.max_memory_allocated() - start


@CUDA
@pytest.mark.parametrize("layer", [nn.LocalResponseNorm(5), LocalResponseNorm(5), Temporaries()],
                         ids=["pytorch-lrn", "one-step-lrn", "user-layer"])
def test_meta_measurement_is_what_cuda_allocates(layer):
    meta, cuda = _peaks(layer, "meta"), _peaks(layer.cuda(), "cuda")
    for measured, predicted in zip(cuda, meta):
        assert abs(measured - predicted) <= 0.02 * predicted + 4096


class _NoMetaBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 3

    @staticmethod
    def backward(ctx, grad):
        if grad.device.type == "meta":
            raise NotImplementedError("no meta kernel for this backward")
        return grad * 3


class NoMetaBackward(nn.Module):
    def forward(self, x):
        return _NoMetaBackward.apply(x)


def test_a_backward_that_cannot_run_on_meta_gets_no_scratch_and_still_plans():
    model = nn.Sequential(nn.Conv2d(16, 16, 1), NoMetaBackward(), nn.ReLU())
    graph = capture(model, SHAPE)
    assert graph.layers[1].backward_scratch == 0
    assert sn.plan(model, SHAPE, "superneurons").peak_bytes > 0
