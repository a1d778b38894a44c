"""Data parallelism: DistributedDataParallel over a wrapped model, two CPU processes (gloo)."""

import gc
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import superneurons as sn
from superneurons import models

STEPS, HALF = 3, 2


def _data():
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(2 * HALF, 3, 32, 32, generator=generator)
    y = torch.randint(0, 10, (2 * HALF,), generator=generator)
    return x, y


def _model():
    torch.manual_seed(0)
    return models.resnet(blocks=(1, 1, 1, 1), num_classes=10)


def _rank(rank: int, init_file: str, out_file: str, policy: str, threads: int):
    torch.set_num_threads(threads)     # the reference's: CPU kernels sum in a thread-count order
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    model = _model()
    ddp = DistributedDataParallel(sn.wrap(model, policy=policy))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = _data()
    mine = slice(rank * HALF, (rank + 1) * HALF)
    for _ in range(STEPS):
        optimizer.zero_grad()
        F.nll_loss(ddp(x[mine]), y[mine]).backward()
        optimizer.step()
    if rank == 0:
        torch.save({"params": [p.detach() for p in model.parameters()],
                    "recomputed": ddp.module.stats.recomputed_layers,
                    "offloaded": ddp.module.stats.offloaded_bytes}, out_file)
    del ddp                    # its reducer (Gloo work) gone before the group, as in
    gc.collect()               # tests/test_state_tier_ddp.py (a known Gloo teardown race)
    dist.barrier()
    dist.destroy_process_group()


def _single_process_reference():
    """The global batch in one process, BatchNorm per half as each rank sees it."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = _data()
    for _ in range(STEPS):
        optimizer.zero_grad()
        halves = [F.nll_loss(model(x[r * HALF:(r + 1) * HALF]), y[r * HALF:(r + 1) * HALF])
                  for r in range(2)]
        (sum(halves) / 2).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.slow
def test_two_gloo_ranks_match_one_process_on_the_global_batch():
    with tempfile.TemporaryDirectory() as folder:
        init_file, out_file = os.path.join(folder, "init"), os.path.join(folder, "out.pt")
        mp.spawn(_rank, args=(init_file, out_file, "superneurons", torch.get_num_threads()),
                 nprocs=2, join=True)
        result = torch.load(out_file)
    expected = _single_process_reference()
    assert result["recomputed"] > 0 and result["offloaded"] > 0
    for got, want in zip(result["params"], expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
