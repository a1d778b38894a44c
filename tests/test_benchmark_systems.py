"""The systems the benchmarks compare (benchmarks/common.py): checkpointing must checkpoint
something in every network, and train as plain PyTorch does."""

import copy
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from common import CheckpointBlocks, _Checkpointed  # noqa: E402
from superneurons import models  # noqa: E402


def test_a_network_without_blocks_is_checkpointed_per_layer_group_and_trains_the_same():
    torch.manual_seed(0)
    plain = models.alexnet(num_classes=10)
    checkpointed = CheckpointBlocks(copy.deepcopy(plain))
    groups = [m for m in checkpointed.modules() if isinstance(m, _Checkpointed)]
    assert len(groups) == 8                       # five CONV and three FC layers, each a group
    x, y = torch.randn(2, 3, 224, 224), torch.randint(0, 10, (2,))
    losses = []
    for model in (plain, checkpointed):
        torch.manual_seed(1)                      # the same dropout masks
        loss = F.nll_loss(model(x), y)
        loss.backward()
        losses.append(loss.detach())
    assert torch.equal(*losses)
    for a, b in zip(plain.parameters(), checkpointed.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=0, atol=1e-6)


def test_networks_with_blocks_are_checkpointed_per_block():
    with torch.device("meta"):
        resnet = CheckpointBlocks(models.build("resnet50"))
    assert sum(isinstance(m, _Checkpointed) for m in resnet.modules()) == 16
