"""The wrapper's list of its model's modules and parameters (runtime/structure.py): read again
when the model changes, however it changes, not walked at every call."""

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
