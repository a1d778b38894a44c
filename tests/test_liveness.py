"""Liveness and the memory model on a small fan, byte for byte, computed by hand."""

import torch
from torch import nn

import superneurons as sn
from superneurons.models.layers import FlattenLinear


class Fan(nn.Module):
    """DATA -> conv1 -> pool -> (conv_a, conv_b) -> add -> fc -> softmax (Figure 3c's shape)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 2, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.conv_a, self.conv_b = nn.Conv2d(2, 2, 1), nn.Conv2d(2, 2, 1)
        self.fc = FlattenLinear(8, 3)
        self.softmax = nn.LogSoftmax(dim=1)

    def forward(self, x):
        p = self.pool(self.conv1(x))
        return self.softmax(self.fc(self.conv_a(p) + self.conv_b(p)))


RESIDENT = 2 * 4 * (20 + 6 + 6 + 27)   # parameters and their gradients, float32


def test_in_and_out_sets_step_by_step():
    plan = sn.plan(Fan(), (2, 1, 4, 4), policy="liveness")
    # Fan is not the project's code, so it is captured by torch.export: fc runs as two layers
    assert plan.route == ["conv1", "pool", "conv_a", "conv_b", "add", "fc:flatten", "fc:linear",
                          "softmax"]
    base = {"input", "conv1", "pool", "pool:saved"}
    expected = {
        4: (base | {"conv_a", "conv_b"}, base | {"add"}),        # the branches die at the join
        5: (base | {"add"}, base | {"add"}),                       # flatten: a view of add
        7: (base | {"add", "fc:linear"}, base | {"add", "softmax"}),  # softmax saves its own
        11: (base | {"grad(add)"}, base | {"grad(add)"}),
        12: (base | {"grad(add)"}, base | {"grad(add)", "grad(pool)"}),
        14: ({"input", "conv1", "pool:saved", "grad(pool)"}, {"input", "grad(conv1)"}),
        15: ({"input", "grad(conv1)"}, set()),
    }
    for step, (live_in, live_out) in expected.items():
        assert plan.in_out(step) == (live_in, live_out), step


def test_exact_bytes_per_step():
    plan = sn.plan(Fan(), (2, 1, 4, 4), policy="liveness")
    # x 128, conv1 256, pool 64 (+128 indices), branches 64 each, add 64, fc 24, softmax 24
    by_hand = [384, 576, 640, 704, 768, 640, 664, 688, 712, 728, 640, 640, 704, 704, 832, 384]
    assert [s.live_bytes - RESIDENT for s in plan.steps] == by_hand
    assert plan.resident_bytes == RESIDENT
    assert plan.peak_bytes == 832 + RESIDENT
    pool = next(layer for layer in plan.layers if layer.name == "pool")
    assert (pool.forward_bytes, pool.backward_bytes) == (448, 704)
    assert plan.max_layer_bytes == 704
    baseline = sn.plan(Fan(), (2, 1, 4, 4), policy="baseline")
    assert baseline.peak_bytes == 1248 + RESIDENT
    assert [s.live_tensors for s in plan.steps][:5] == [2, 4, 5, 6, 7]


def test_meta_and_real_inputs_plan_alike():
    model = Fan()
    from_shape = sn.plan(model, (2, 1, 4, 4))
    from_tensor = sn.plan(model, torch.randn(2, 1, 4, 4))
    assert [s.live_bytes for s in from_shape.steps] == [s.live_bytes for s in from_tensor.steps]
