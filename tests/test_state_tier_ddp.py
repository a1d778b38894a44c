"""Data parallelism with the model's state in host memory: sn.wrap(..., state="host",
process_group=group) trains as DistributedDataParallel around the plain model does, bit for bit,
on two CPU processes (gloo); DDP around such a wrapper is refused before any collective.

Each rank builds its model from its own seed (so the broadcast from rank 0 matters), trains it
under plain DDP and then wrapped, on its own data, and compares losses, parameters, gradients,
buffers and optimizer state with torch.equal; the ranks write what differed."""

import gc
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import superneurons as sn
from superneurons.runtime import data_parallel

STEPS = 3


def _resnet(rank):
    torch.manual_seed(rank)                 # ranks differ until rank 0's state is broadcast
    model = sn.models.resnet(blocks=(1, 1, 1, 1), num_classes=10)

    def batch(step, micro):
        g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
        x, y = torch.randn(2, 3, 32, 32, generator=g), torch.randint(0, 10, (2,), generator=g)
        return (x,), {}, lambda out: F.cross_entropy(out, y)
    return model, batch


def _gpt2(rank):
    import transformers as tf
    torch.manual_seed(rank)
    config = tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=16,
                           use_cache=False)
    model = tf.GPT2LMHeadModel(config)      # tied embeddings: one parameter, two uses

    def batch(step, micro):
        g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
        ids = torch.randint(0, 64, (2, 16), generator=g)
        return (), {"input_ids": ids, "labels": ids}, lambda out: out.loss
    return model, batch


class _Unused(nn.Module):
    """A parameter no rank uses: DDP (find_unused_parameters=True) leaves its .grad alone."""

    def __init__(self, spare_on_this_rank=False):
        super().__init__()
        self.used, self.spare = nn.Linear(8, 4), nn.Linear(8, 4)
        self.spare_on_this_rank = spare_on_this_rank

    def forward(self, x):
        out = self.used(x)
        return out + self.spare(x) if self.spare_on_this_rank else out


def _unused(rank, by_rank=False):
    """by_rank: rank 1 uses the spare parameters and rank 0 does not (each rank's collectives
    must still pair up)."""
    torch.manual_seed(rank)
    model = _Unused(spare_on_this_rank=by_rank and rank == 1)

    def batch(step, micro):
        g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
        x = torch.randn(4, 8, generator=g)
        return (x,), {}, lambda out: out.square().mean()
    return model, batch


CASES = {"resnet": _resnet, "gpt2": _gpt2, "unused": _unused,
         "unused on one rank": lambda rank: _unused(rank, by_rank=True)}


def _optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3)


def _train(case, optimizer_name, rank, how, accumulate):
    """how: "ddp" (plain DDP), "tier" (process_group=) or "alone" (state="host", no group).
    accumulate: two micro-batches a step, the first inside no_sync() in even steps and synced
    in odd ones (DDP then averages the .grad accumulated so far); None: one."""
    model, batch = CASES[case](rank)
    # many buckets, each reduced as soon as it fills (in backward, not only at its end)
    data_parallel.REDUCE_BUCKET_BYTES = 4096 if how == "tier, small buckets" else 25 * 2**20
    if how == "ddp":
        run = DistributedDataParallel(model, find_unused_parameters=case.startswith("unused"))
    else:
        group = dist.group.WORLD if how.startswith("tier") else None
        run = sn.wrap(model, policy="superneurons", state="host", device="cpu",
                      process_group=group)
    optimizer = _optimizer(optimizer_name, model.parameters())
    losses, grads = [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        for micro in range(1 if accumulate is None else 2):
            args, kwargs, loss_fn = batch(step, micro)
            torch.manual_seed(100 + step)           # dropout draws the same in both
            quiet = run.no_sync() if accumulate and micro == 0 and step % 2 == 0 \
                else _nothing()
            with quiet:
                loss = loss_fn(run(*args, **kwargs))
                loss.backward()
            losses.append(loss.detach())
        grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        optimizer.step()
    return {"losses": losses, "grads": grads, "state": model.state_dict(),
            "optimizer": [{k: v for k, v in s.items() if torch.is_tensor(v)}
                          for s in optimizer.state.values()]}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _differences(a, b) -> list:
    """What differs between two _train results (empty: bit for bit the same)."""
    out = [f"loss {i}" for i, (x, y) in enumerate(zip(a["losses"], b["losses"]))
           if not torch.equal(x, y)]
    for step, (ga, gb) in enumerate(zip(a["grads"], b["grads"])):
        out += [f"grad {step}.{i}" for i, (x, y) in enumerate(zip(ga, gb))
                if (x is None) != (y is None) or (x is not None and not torch.equal(x, y))]
    out += [f"state {k}" for k in a["state"] if not torch.equal(a["state"][k], b["state"][k])]
    if len(a["optimizer"]) != len(b["optimizer"]):
        out.append("optimizer state count")
    for i, (x, y) in enumerate(zip(a["optimizer"], b["optimizer"])):
        out += [f"optimizer {i}.{k}" for k in x if not torch.equal(x[k], y[k])]
    return out


def _rank(rank, init_file, out_dir, runs):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    found = {}
    try:
        for name, (case, optimizer, other, accumulate) in runs.items():
            if other == "refused":         # DDP around the wrapper, and inside it
                found[name] = [
                    _refusal(lambda: DistributedDataParallel(
                        sn.wrap(CASES[case](rank)[0], state="host", device="cpu"))),
                    _refusal(lambda: sn.wrap(DistributedDataParallel(CASES[case](rank)[0]),
                                             state="host", device="cpu"))]
                continue
            reference = _train(case, optimizer, rank, "ddp", accumulate)
            found[name] = _differences(reference, _train(case, optimizer, rank, other,
                                                         accumulate))
    finally:
        torch.save(found, os.path.join(out_dir, f"rank{rank}.pt"))
    # DDP's reducers (which hold Gloo work) gone and both ranks done before the group goes: a
    # rank aborted at exit otherwise once, under load ("terminate called without an active
    # exception"), as cli/train_cmd.py's ranks did (a known Gloo teardown race)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def _refusal(make) -> str:
    try:
        make()
    except ValueError as error:
        return str(error)
    return "accepted"


def _spawn(runs: dict) -> list:
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_rank, args=(os.path.join(folder, "init"), folder, runs), nprocs=2, join=True)
        return [torch.load(os.path.join(folder, f"rank{r}.pt")) for r in range(2)]


def test_the_tier_averages_as_ddp_does_bit_for_bit():
    """SGD with momentum on a model with BatchNorm buffers (broadcast before each forward),
    micro-batches under no_sync() and synced; AdamW with a parameter no rank uses; and the
    control: without process_group the same comparison finds differences."""
    runs = {"resnet sgd micro-batches": ("resnet", "sgd", "tier", "micro"),
            "unused adamw": ("unused", "adamw", "tier", None),
            "unused on one rank sgd": ("unused on one rank", "sgd", "tier", None),
            "resnet adamw small buckets": ("resnet", "adamw", "tier, small buckets", "micro"),
            "control: no process group": ("unused", "adamw", "alone", None),
            "ddp around a host-state wrap": ("resnet", None, "refused", None)}
    for rank, found in enumerate(_spawn(runs)):
        for name in runs:
            if name.startswith("control"):
                assert found[name], (rank, name)            # the comparison can fail
            elif name.startswith("ddp around"):
                assert all("process_group=" in m for m in found[name]), (rank, found[name])
            else:
                assert found[name] == [], (rank, name, found[name][:5])


def test_an_hf_decoder_with_tied_embeddings_averages_as_ddp_does():
    pytest.importorskip("transformers")
    runs = {"gpt2 adamw": ("gpt2", "adamw", "tier", None)}
    for rank, found in enumerate(_spawn(runs)):
        assert found["gpt2 adamw"] == [], (rank, found["gpt2 adamw"][:5])


def test_process_group_needs_state_on_the_host():
    with pytest.raises(ValueError, match="process_group= is for state='host'"):
        sn.wrap(nn.Linear(2, 2), process_group=object())


def _refusing_rank(rank, init_file, out_dir):
    """Rank 1 alone lacks host memory at wrap: both ranks must raise (a rank left in a
    collective would wait out the timeout instead). Then ranks whose batches differ in shape
    (a short last batch on one) reach their plans' first steps at different calls: nothing may
    wait for the other there."""
    import datetime
    from superneurons.runtime import module
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    found = {}
    try:
        model, _ = _resnet(rank)
        fits = module.check_state_fits

        def at_wrap(*args):
            if rank == 1:
                raise ValueError("not enough host memory on this rank")
            return fits(*args)
        module.check_state_fits = at_wrap
        found["wrap"] = _refusal(lambda: sn.wrap(model, state="host", device="cpu",
                                                 process_group=dist.group.WORLD))
        module.check_state_fits = fits
        wrapped = sn.wrap(model, state="host", device="cpu", process_group=dist.group.WORLD)
        for batch in ([4, 4], [4, 3])[rank]:
            x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
            F.cross_entropy(wrapped(x), y).backward()
        found["shapes"] = "trained"
    finally:
        torch.save(found, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def test_a_host_memory_refusal_at_wrap_stops_every_rank_and_first_steps_do_not_wait():
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_refusing_rank, args=(os.path.join(folder, "init"), folder), nprocs=2,
                 join=True)
        found = [torch.load(os.path.join(folder, f"rank{r}.pt")) for r in range(2)]
    assert "not enough host memory" in found[1]["wrap"]
    assert "failed on rank(s) [1]" in found[0]["wrap"]
    assert found[0]["shapes"] == found[1]["shapes"] == "trained"
