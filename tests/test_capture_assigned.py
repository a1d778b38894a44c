"""Plain attributes a forward changes are refused before a step (capture/assigned.py): export
puts them back and the captured graph never runs the forward's Python, so they would stay as
they were, where plain PyTorch writes them at every call."""

import pytest
import torch
from torch import nn

import superneurons as sn
from equality import assert_same_training

X = torch.randn(2, 4, 8)


class Layer(nn.Module):
    def __init__(self, write):
        super().__init__()
        self.lin, self.write = nn.Linear(8, 8), write
        self.counter, self.scale, self.flag, self.history = 0, 2.0, False, []

    def forward(self, x):
        self.write(self, x)
        return self.lin(x) * self.scale


class Model(nn.Module):
    """The layer at encoder.layer.0, as in HF's encoders."""

    def __init__(self, write):
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList([Layer(write)])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.encoder.layer[0](x))


def _count(layer, x):
    layer.counter += 1


def _count_again(layer, x):
    layer.counter = layer.counter + 1


def _flag(layer, x):
    layer.flag = True


def _start_counting(layer, x):
    layer.calls = getattr(layer, "calls", 0) + 1


def _append(layer, x):
    layer.history.append(x.shape[0])      # export puts the copy of the list back


@pytest.mark.parametrize("write, name", [(_count, "counter"), (_count_again, "counter"),
                                         (_flag, "flag"), (_start_counting, "calls"),
                                         (_append, "history")],
                         ids=["+=", "= +1", "flag", "created", "append"])
def test_a_plain_attribute_the_forward_changes_is_refused_by_its_qualified_name(write, name):
    with pytest.raises(ValueError, match=rf"assigns encoder\.layer\.0\.{name} .*pass the "
                                         r"count in as an argument.*children: encoder, head"):
        sn.wrap(Model(write))(X)


def _equal(layer, x):
    layer.scale = 2.0
    layer.training = layer.training
    layer.counter = layer.counter + 0


def _local(layer, x):
    counter = layer.counter
    counter += 1


@pytest.mark.parametrize("write", [_equal, _local], ids=["equal", "local"])
def test_a_forward_leaving_its_attributes_equal_trains_bit_for_bit(write):
    assert_same_training(Model(write), X, None, loss_fn=lambda out, _: out.square().mean(),
                         policy="recompute")


def _shape(layer, x):
    layer.last_shape = x.shape            # created by the first call, equal at every other


def test_an_attribute_set_once_is_refused_until_the_model_was_called_once():
    """One call cannot tell a value set once from a counter started there (the "created" case
    above); after a plain call the capture finds it equal."""
    model = Model(_shape)
    with pytest.raises(ValueError, match=r"encoder\.layer\.0\.last_shape \(unset before the "
                                         r"call, torch.Size.*call the model once before"):
        sn.wrap(model)(X)
    assert not hasattr(model.encoder.layer[0], "last_shape")    # not left with capture's
    model(X)
    assert_same_training(model, X, None, loss_fn=lambda out, _: out.square().mean(),
                         policy="recompute")


class Counting(nn.Module):
    """A leaf of the user's own: no children, its forward bumps a counter."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.tanh(x)


def test_a_users_leaf_whose_forward_counts_is_refused_and_left_as_it_was():
    """torch.fx runs a user's leaf as a layer: at capture's analysis and at every replay too,
    so the counter read 3 after one recomputed step where plain PyTorch's reads 1."""
    model = nn.Sequential(nn.Linear(8, 8), Counting(), nn.Linear(8, 2))
    with pytest.raises(ValueError, match=r"assigns 1\.calls .*every replay"):
        sn.wrap(model, policy="recompute")(torch.randn(4, 8))
    assert model[1].calls == 0


class NumpyNoise(nn.Module):
    def forward(self, x):
        import numpy
        return x + float(numpy.random.rand())


def test_a_users_leaf_drawing_from_numpy_is_refused():
    """Its replay would draw other numbers than its forward did."""
    pytest.importorskip("numpy")
    with pytest.raises(ValueError, match="np.random.*every replay"):
        sn.wrap(nn.Sequential(nn.Linear(8, 8), NumpyNoise()), policy="recompute")(
            torch.randn(4, 8))
