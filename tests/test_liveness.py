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
        # fc:linear's gradient for the flatten, which the flatten and the add hand on
        11: (base | {"grad(fc:flatten)"}, base | {"grad(fc:flatten)"}),
        12: (base | {"grad(fc:flatten)"}, base | {"grad(fc:flatten)", "grad(pool)"}),
        14: ({"input", "conv1", "pool:saved", "grad(pool)"}, {"input", "grad(conv1)"}),
        15: ({"input", "grad(conv1)"}, set()),
    }
    for step, (live_in, live_out) in expected.items():
        assert plan.in_out(step) == (live_in, live_out), step


def test_exact_bytes_per_step():
    plan = sn.plan(Fan(), (2, 1, 4, 4), policy="liveness")
    # x 128, conv1 256, pool 64 (+128 indices), branches 64 each, add 64, fc 24, softmax 24
    # step 13: conv_a's gradient for pool lives beside the one conv_b left, then is added in
    by_hand = [384, 576, 640, 704, 768, 640, 664, 688, 712, 728, 640, 640, 704, 768, 832, 384]
    assert [s.live_bytes - RESIDENT for s in plan.steps] == by_hand
    assert plan.resident_bytes == RESIDENT
    assert plan.peak_bytes == 832 + RESIDENT
    pool = next(layer for layer in plan.layers if layer.name == "pool")
    assert (pool.forward_bytes, pool.backward_bytes) == (448, 704)
    assert plan.max_layer_bytes == 704
    baseline = sn.plan(Fan(), (2, 1, 4, 4), policy="baseline")
    assert baseline.peak_bytes == 1312 + RESIDENT      # frees nothing, conv_a's gradient included
    assert [s.live_tensors for s in plan.steps][:5] == [2, 4, 5, 6, 7]


def test_meta_and_real_inputs_plan_alike():
    model = Fan()
    from_shape = sn.plan(model, (2, 1, 4, 4))
    from_tensor = sn.plan(model, torch.randn(2, 1, 4, 4))
    assert [s.live_bytes for s in from_shape.steps] == [s.live_bytes for s in from_tensor.steps]


class Dense(nn.Module):
    """x -> conv1 -> cat(x, f1) -> conv2 -> cat(x, f1, f2) -> conv3: a DenseNet block's fan."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(2, 2, 1), nn.Conv2d(4, 2, 1)
        self.conv3 = nn.Conv2d(6, 2, 1)

    def forward(self, x):
        f1 = self.conv1(self.conv1(x))          # x's own producer, so its gradient is counted
        f2 = self.conv2(torch.cat([x, f1], 1))
        return self.conv3(torch.cat([x, f1, f2], 1))


def test_a_concatenation_hands_slices_of_one_gradient():
    """A concatenation's backward hands each input a slice of its output's gradient: that
    gradient lives until every slice was added to another (a fresh buffer) or consumed."""
    plan = sn.plan(Dense(), (2, 2, 4, 4), policy="liveness")
    steps = {name: index for index, name in enumerate(plan.route)}
    bwd = {name: 2 * len(plan.route) - 1 - index for name, index in steps.items()}
    grads = [b for b in plan.buffers if b.label.startswith("grad(cat")]
    wide = max(grads, key=lambda b: b.nbytes)     # the second concatenation's: 6 channels
    assert wide.nbytes == 2 * 6 * 16 * 4
    # from conv3's backward until the first concatenation's backward adds to x's and f1's slices
    assert wide.intervals == ((bwd["conv3"], bwd["cat"]),)
    # conv2's backward: its gradient for the first concatenation beside the wide one
    assert {"grad(cat)", "grad(cat_1)"} <= plan.in_out(bwd["conv2"])[1]


def test_an_in_place_layer_makes_a_fresh_gradient_beside_its_outputs():
    """ReLU(inplace=True)'s backward writes a new gradient for its input while its output's
    lives: two buffers of the storage at that step, one after."""

    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.fc2(torch.relu_(self.fc1(x)))

    plan = sn.plan(InPlace(), (2, 4), policy="liveness")
    relu = next(layer for layer in plan.graph.layers if layer.kind == "ACT")
    at = 2 * len(plan.route) - 1 - plan.route.index(relu.name)
    grads = {b.label: b.intervals for b in plan.buffers if b.label.startswith("grad(")}
    assert grads[f"grad({relu.name})"] == ((at - 1, at),)      # fc2's, for the ReLU's output
    assert grads["grad(fc1)"] == ((at, at + 1),)                 # the ReLU's, for fc1's


def test_a_slice_makes_a_gradient_of_its_whole_input():
    """A slice's backward writes into zeros of its input's size (not a view of its own
    gradient, as a reshape's is): each of a rotation's two halves makes one (RoPE's
    rotate_half), the second added into the first in place."""

    class Rotate(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 4)

        def forward(self, x):
            h = self.fc1(x)
            return self.fc2(torch.cat([-h[:, 4:], h[:, :4]], 1).reshape(2, 8))

    plan = sn.plan(Rotate(), (2, 4), policy="liveness")
    whole = 2 * 8 * 4
    for_h = [b for b in plan.buffers if b.label == "grad(fc1)"]
    assert len(for_h) == 2 and all(b.nbytes == whole for b in for_h)


class Twice(nn.Module):
    """h + h, then a residual add of a float32 norm and a bfloat16 projection of it."""

    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc1(x)
        n = self.norm(h + h)
        return n + self.fc2(n).to(torch.bfloat16)


def _bwd(plan, name: str) -> int:
    return 2 * len(plan.route) - 1 - plan.route.index(name)


def test_the_same_tensor_twice_is_summed_into_a_fresh_gradient():
    plan = sn.plan(Twice(), (2, 4), policy="liveness")
    first_add = plan.route[1]
    made = [b.intervals[0][0] for b in plan.buffers if b.label == "grad(fc1)"]
    assert made == [_bwd(plan, first_add)]         # h's own gradient: the sum, made there


def test_an_add_across_dtypes_casts_a_fresh_gradient():
    plan = sn.plan(Twice(), (2, 4), policy="liveness")
    last_add = plan.route[-1]
    # the float32 output's gradient is handed to the float32 norm, cast for the bfloat16 input
    made = sorted((b.nbytes, b.label) for b in plan.buffers
                  if b.label.startswith("grad(") and b.label != f"grad({last_add})"
                  and b.intervals[0][0] == _bwd(plan, last_add))
    assert made == [(2 * 8 * 2, f"grad({plan.route[-2]})")]


class Residual(nn.Module):
    """A float32 norm, a residual add of it and a linear of it, and a head: under CPU autocast
    the linears compute in bfloat16, the norm and the add in float32."""

    def __init__(self):
        super().__init__()
        self.ln, self.fc, self.head = nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = self.ln(x)
        return self.head(h + self.fc(h))


def test_a_layer_computing_in_bfloat16_makes_its_inputs_gradient_in_bfloat16_first():
    """Under autocast the head's backward writes the float32 add's gradient in bfloat16, then
    casts it: both live at its step (as PyTorch's CPU memory profiler shows)."""
    plan = sn.plan(Residual(), (2, 8), policy="liveness", autocast=torch.bfloat16,
                   device_type="cpu")
    at = _bwd(plan, "head")
    made = sorted(b.nbytes for b in plan.buffers
                  if b.label == "grad(add)" and b.intervals[0][0] == at)
    assert made == [2 * 8 * 2, 2 * 8 * 4]
