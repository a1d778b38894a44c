"""The wrapper's list of its model's modules and parameters (runtime/structure.py): read again
when the model changes, not walked at every call."""

import torch
from torch import nn

from superneurons.runtime.structure import Structure


def test_the_key_follows_modes_flags_and_new_modules():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    structure = Structure(model)
    first = structure.key()
    model.eval()
    assert structure.key() != first
    model.train()
    model[0].weight.requires_grad_(False)
    assert structure.key() != first
    model[0].weight.requires_grad_(True)
    assert structure.key() == first
    model.append(nn.Linear(2, 2))                 # registered after the first listing
    assert len(structure.key()[0]) == 4 and len(structure.parameters) == 6
    model[2].bias = nn.Parameter(torch.zeros(2), requires_grad=False)    # replaced in place
    assert structure.parameters[-1] is model[2].bias
    assert structure.key()[1][-1] is False
