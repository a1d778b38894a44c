"""The wrapped model keeps the model's own interface: its call, its output, its checkpoints."""

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import superneurons as sn


class Scaled(nn.Module):
    """Keyword arguments (a tensor and a number the graph specializes on), a dict out."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(),
                                  nn.Linear(16, 8), nn.ReLU())
        self.head = nn.Linear(8, 3)

    def forward(self, x, *, bias=None, scale=1.0):
        h = self.body(x) * scale
        if bias is not None:
            h = h + bias
        return {"logits": self.head(h), "features": h}


def _step(model, x, **kwargs):
    out = model(x, **kwargs)
    loss = F.cross_entropy(out["logits"], torch.arange(x.shape[0]) % 3)
    loss.backward()
    return loss.detach()


def test_state_dict_uses_the_models_own_keys_both_ways():
    torch.manual_seed(0)
    model = Scaled()
    wrapped = sn.wrap(copy.deepcopy(model), policy="recompute")
    assert list(wrapped.state_dict()) == list(model.state_dict())
    parent = nn.ModuleDict({"net": sn.wrap(copy.deepcopy(model))})
    assert list(parent.state_dict()) == [f"net.{k}" for k in model.state_dict()]
    trained = Scaled()
    wrapped.load_state_dict(trained.state_dict())          # plain checkpoint into wrapped
    plain = Scaled()
    plain.load_state_dict(wrapped.state_dict())            # and back
    for key, value in trained.state_dict().items():
        assert torch.equal(plain.state_dict()[key], value), key


def test_keywords_and_numbers_get_plans_of_their_own():
    torch.manual_seed(0)
    model = Scaled()
    plain, wrapped = copy.deepcopy(model), sn.wrap(copy.deepcopy(model), policy="recompute")
    x, bias = torch.randn(4, 8), torch.randn(8)
    for kwargs in ({}, {"scale": 2.0}, {"scale": 2.0, "bias": bias}, {"scale": 3.0}):
        torch.manual_seed(1)
        expected = _step(plain, x, **kwargs)
        torch.manual_seed(1)
        assert torch.equal(_step(wrapped, x, **kwargs), expected), kwargs
    assert len(wrapped._executors) == 4
    for a, b in zip(plain.parameters(), wrapped.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_a_wrapped_model_saves_and_loads_after_training():
    torch.manual_seed(0)
    wrapped = sn.wrap(Scaled(), policy="superneurons")
    x = torch.randn(4, 8)
    for _ in range(2):
        _step(wrapped, x, scale=2.0)
    buffer = io.BytesIO()
    torch.save(wrapped, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded._executors == {}                       # plans are made again
    wrapped.eval(), loaded.eval()
    with torch.no_grad():
        assert torch.equal(loaded(x)["logits"], wrapped(x)["logits"])
    loaded.train()
    _step(loaded, x, scale=2.0)                           # and it trains again


def test_plan_takes_the_models_own_arguments():
    model = Scaled()
    x = torch.randn(4, 8)
    by_args = sn.plan(model, (x,), kwargs={"scale": 2.0})
    by_tensor = sn.plan(model, x, kwargs={"scale": 2.0})
    assert by_args.peak_bytes == by_tensor.peak_bytes > 0
    with pytest.raises(ValueError, match="could not capture Scaled called with these arguments.*broadcast"):
        sn.plan(model, x, kwargs={"bias": torch.randn(5)})  # plain PyTorch fails on it too
