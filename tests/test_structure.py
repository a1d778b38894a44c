"""The wrapper's list of its model's modules and parameters (runtime/structure.py): read again
when the model changes, however it changes, not walked at every call."""

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import superneurons as sn
from superneurons.runtime.structure import Structure


def test_the_key_follows_modes_flags_and_every_change_of_the_tree():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    structure = Structure(model)
    first, _ = structure.read()
    model.eval()
    assert structure.read()[0] != first
    model.train()
    model[0].weight.requires_grad_(False)
    assert structure.read()[0] != first
    model[0].weight.requires_grad_(True)
    assert structure.read()[0] == first
    model.append(nn.Linear(2, 2))                                       # registered
    key, parameters = structure.read()
    assert len(key[0]) == 4 and len(parameters) == 6
    model[2].bias = nn.Parameter(torch.zeros(2), requires_grad=False)  # replaced
    assert structure.read()[1][-1] is model[2].bias and structure.read()[0][1][-1] is False
    model[2].bias = None                                        # no registration hook runs
    assert len(structure.read()[1]) == 5
    model[0]._parameters["weight"] = nn.Parameter(torch.ones(2, 2), requires_grad=False)
    assert structure.read()[0][1][0] is False                            # written directly
    del model[2]                                                        # __delattr__
    assert len(structure.read()[0][0]) == 3


class _OptionalHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        x = self.body(x)
        return self.head(x) if hasattr(self, "head") else x


def test_a_deleted_module_is_a_new_plan():
    model = _OptionalHead()
    wrapped = sn.wrap(model, policy="recompute")
    x = torch.randn(3, 4)
    assert wrapped(x).shape == (3, 2)
    del model.head
    out = wrapped(x)
    assert out.shape == (3, 4) and torch.equal(out, model(x))
    F.mse_loss(out, torch.zeros(3, 4)).backward()


class _Scheduled(nn.Module):
    """A dropout whose p a schedule sets between steps, and a norm whose eps is changed."""

    def __init__(self):
        super().__init__()
        self.body, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)
        self.drop, self.head = nn.Dropout(0.1), nn.Linear(8, 3)

    def forward(self, x):
        return F.log_softmax(self.head(self.drop(self.norm(torch.relu(self.body(x))))), -1)


def _trained(model, x, y, change, steps: int = 4, call=None, lr: float = 0.1) -> list:
    """Losses of SGD steps of ``call`` (the model itself by default), ``change(model, step)``
    setting the model's values before each."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    torch.manual_seed(1)
    losses = []
    for step in range(steps):
        change(model, step)
        optimizer.zero_grad()
        loss = F.nll_loss((call or model)(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _schedule(number):
    def change(model, step):
        p, eps = [(0.1, 1e-5), (0.5, 1e-5), (0.5, 0.5), (0.1, 1e-5)][step]
        model.drop.p, model.norm.eps = number(p), eps
    return change


@pytest.mark.parametrize("number", [float, np.float32], ids=["float", "numpy"])
def test_a_scalar_changed_between_steps_is_the_value_the_step_trains_with(number):
    """A schedule's values are Python's floats, or numpy's (np.linspace's)."""
    torch.manual_seed(0)
    model, x, y = _Scheduled(), torch.randn(6, 8), torch.randint(0, 3, (6,))
    plain, managed = _Scheduled(), _Scheduled()
    plain.load_state_dict(model.state_dict())
    managed.load_state_dict(model.state_dict())
    expected = _trained(plain, x, y, _schedule(number))
    wrapped = sn.wrap(managed, policy="recompute")
    with pytest.warns(UserWarning, match=r"drop\.p changed from .*0\.1.* to .*0\.5"):
        got = _trained(managed, x, y, _schedule(number), call=wrapped)
    assert expected == got, (expected, got)
    for a, b in zip(plain.parameters(), managed.parameters()):
        assert torch.equal(a, b)
    assert len(wrapped._executors) == 3        # the values of step 4 are step 1's: its plan


def test_a_scalar_that_becomes_a_tensor_leaves_the_key():
    model = nn.Sequential(nn.Dropout(0.1))
    structure = Structure(model)
    first = structure.read()[0]
    model[0].p = torch.tensor(0.2)               # an object now: not a constant of the key
    assert len(structure.read()[0][2]) == len(first[2]) - 1


def test_a_flag_in_a_config_the_forward_reads_is_keyed():
    """nanoGPT's and HF's modules hold a config whose flags the forward reads (Gemma2's logit
    softcapping): changed between steps, the step trains on the new value, as plain does."""
    from dataclasses import dataclass

    @dataclass
    class Config:
        softcap: float = 30.0

    class Capped(nn.Module):
        def __init__(self):
            super().__init__()
            self.config, self.lin = Config(), nn.Linear(8, 3)

        def forward(self, x):
            logits = self.lin(x)
            return F.log_softmax(torch.tanh(logits / self.config.softcap) * 3.0, -1)

    torch.manual_seed(0)
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    plain, managed = Capped(), Capped()
    managed.load_state_dict(plain.state_dict())

    def change(model, step):
        model.config.softcap = (30.0, 0.5, 0.5)[step]
    wrapped = sn.wrap(managed, policy="recompute")
    assert _trained(plain, x, y, change, 3, lr=0.5) == \
        _trained(managed, x, y, change, 3, call=wrapped, lr=0.5)


class _ScaledByDefault(nn.Module):
    """A scale the class holds, which a schedule sets on the instance; and a class held as a
    config, a namespace of constants."""

    scale = 1.0

    class Constants:
        shift = 0.5

    def __init__(self):
        super().__init__()
        self.lin, self.config = nn.Linear(8, 3), self.Constants

    def forward(self, x):
        return F.log_softmax(self.lin(x) * self.scale + self.config.shift, -1)


def test_a_class_default_set_on_the_instance_is_keyed_and_a_class_config_is_not_read():
    torch.manual_seed(0)
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    plain, managed = _ScaledByDefault(), _ScaledByDefault()
    managed.load_state_dict(plain.state_dict())

    def change(model, step):
        if step == 1:
            model.scale = 3.0
    wrapped = sn.wrap(managed, policy="recompute")
    assert _trained(plain, x, y, change, 3, lr=0.5) == \
        _trained(managed, x, y, change, 3, call=wrapped, lr=0.5)


def test_a_config_value_the_forward_sets_at_its_first_call_is_no_change():
    """HF's sequence classifiers set config.problem_type at their first call: the key is read
    after capture, so the next step neither captures again nor warns."""
    from types import SimpleNamespace

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.config, self.lin = SimpleNamespace(problem_type=None), nn.Linear(8, 3)

        def forward(self, x):
            if self.config.problem_type is None:
                self.config.problem_type = "single_label_classification"
            return F.log_softmax(self.lin(x), -1)

    torch.manual_seed(0)
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    plain, managed = Classifier(), Classifier()
    managed.load_state_dict(plain.state_dict())
    wrapped = sn.wrap(managed, policy="recompute")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _trained(managed, x, y, lambda model, step: None, 3, call=wrapped)
    assert got == _trained(plain, x, y, lambda model, step: None, 3)
    assert len(wrapped._executors) == 1
