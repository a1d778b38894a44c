"""Data parallelism with the model's state in host memory, on two GPUs (NCCL; gloo with --device
cpu for a smoke run): sn.wrap(model, state="host", process_group=WORLD) against plain DDP, and
FSDP2 (fully_shard), which shards the state instead of streaming it.

    python benchmarks/state_tier_ddp.py OUT_DIR exact                 # bit for bit vs plain DDP
    python benchmarks/state_tier_ddp.py OUT_DIR throughput [--n3 1200 --batch 16 --single]
    python benchmarks/state_tier_ddp.py OUT_DIR fsdp [--n3 1200 --batches 16 8 4 2]

exact: the zoo's ResNet (SGD with momentum, BatchNorm buffers) and an HF GPT-2 from a small
config (AdamW, dropout, tied embeddings), each rank seeded differently (rank 0's state is
broadcast) and fed its own data, trained STEPS steps under plain DDP twice (the second is the
control) and wrapped with the state on the host, deterministic kernels; per rank: losses equal,
largest difference over parameters, gradients, buffers and optimizer state.
throughput: a bottleneck ResNet [3, 4, n3, 3] (n3 1200: 3,632 layers, 5.4 GB of weights, 16 GB
with gradients and momentum: more than one GPU's 12 GiB cap) at batch --batch per GPU, state
streamed within BUDGET under the cap, SGD with momentum on the host; per step seconds, images/s
over both GPUs, peak memory, bytes moved; --single adds one GPU alone (no process group).
fsdp: the same model and cap under fully_shard per block (torch.utils.checkpoint per block, and
with CPUOffloadPolicy), from the largest of --batches down until a step fits.
Every case runs in fresh processes (one per rank) within --timeout; OUT_DIR/state_tier_ddp_<case>
[_cpu].json holds the record.
"""

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
CAP_GIB, BUDGET, STEPS = 12.0, "11.5GiB", 3
# never NVLink multicast on a shared host (on_gpus.py)
SAFE_ENVIRONMENT = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                    "NVSHMEM_DISABLE_NVLS": "1"}


def _setup(rank, world, init_file, cuda, deterministic=False):
    from common import torch_settings
    torch_settings(deterministic)
    import torch
    import torch.distributed as dist
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=world,
                            **({"device_id": device} if cuda else {}))
    return torch, dist, device


def _cap(torch, device) -> None:
    """One GPU's 12 GiB: the caching allocator refuses past it."""
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(CAP_GIB * 2**30 / total, device)


# -- exact ------------------------------------------------------------------------------------
def _exact_model(name, rank, torch):
    import superneurons as sn
    torch.manual_seed(rank)                 # different per rank: rank 0's state is broadcast
    if name == "resnet":
        model = sn.models.resnet(blocks=(1, 2, 2, 1), num_classes=10)

        def batch(step):
            g = torch.Generator().manual_seed(1000 * rank + step)
            x, y = torch.randn(8, 3, 64, 64, generator=g), torch.randint(0, 10, (8,), generator=g)
            return (x,), {}, lambda out, y=y: torch.nn.functional.cross_entropy(
                out, y.to(out.device))
        return model, batch, "sgd"
    import transformers as tf
    config = tf.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, use_cache=False)
    model = tf.GPT2LMHeadModel(config)

    def batch(step):
        g = torch.Generator().manual_seed(1000 * rank + step)
        ids = torch.randint(0, 256, (2, 64), generator=g)
        return (), {"input_ids": ids, "labels": ids}, lambda out: out.loss
    return model, batch, "adamw"


def _exact_train(name, how, rank, device, torch, dist):
    import superneurons as sn
    from torch.nn.parallel import DistributedDataParallel
    model, batch, optimizer_name = _exact_model(name, rank, torch)
    if how == "ddp":
        model = model.to(device)
        run = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda"
                                      else None)
    else:
        run = sn.wrap(model, policy="superneurons", budget=None, state="host", device=device,
                      process_group=dist.group.WORLD)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9) if optimizer_name == "sgd" \
        else torch.optim.AdamW(params, lr=1e-3)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        args, kwargs, loss_fn = batch(step)
        torch.manual_seed(100 + step)                   # dropout draws the same
        args = [a.to(device) for a in args]
        kwargs = {k: v.to(device) for k, v in kwargs.items()}
        loss = loss_fn(run(*args, **kwargs))
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().cpu())
    state = {"params": {n: p.detach().cpu() for n, p in model.named_parameters()},
             "grads": {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None},
             "buffers": {n: b.cpu() for n, b in model.named_buffers()},
             "optimizer": {f"{i}.{k}": v.cpu() for i, s in enumerate(optimizer.state.values())
                           for k, v in s.items() if torch.is_tensor(v)}}
    return losses, state


def _max_diff(torch, a: dict, b: dict) -> float:
    worst = 0.0
    for part in a:
        if set(a[part]) != set(b[part]):
            return float("inf")
        for key, x in a[part].items():
            if not torch.equal(x, b[part][key]):
                worst = max(worst, (x.double() - b[part][key].double()).abs().max().item())
    return worst


def exact_rank(rank, world, init_file, cuda, options):
    torch, dist, device = _setup(rank, world, init_file, cuda, deterministic=True)
    rows = []
    for name in options["models"]:
        row = {"model": name}
        try:
            plain = _exact_train(name, "ddp", rank, device, torch, dist)
            control = _exact_train(name, "ddp", rank, device, torch, dist)
            began = time.perf_counter()
            tier = _exact_train(name, "tier", rank, device, torch, dist)
            row.update(
                tier_s=time.perf_counter() - began,
                losses_equal=all(torch.equal(a, b) for a, b in zip(plain[0], tier[0])),
                max_diff=_max_diff(torch, plain[1], tier[1]),
                control_losses_equal=all(torch.equal(a, b) for a, b in zip(plain[0], control[0])),
                control_max_diff=_max_diff(torch, plain[1], control[1]),
                losses=[float(x) for x in tier[0]])
        except Exception as error:          # recorded; the other model still runs
            row["error"] = f"{type(error).__name__}: {str(error)[:400]}"
        rows.append(row)
        print(json.dumps({"rank": rank, **row}), flush=True)
    return {"models": rows}


# -- throughput and FSDP2 ---------------------------------------------------------------------
def _deep(torch, rank, n3, batch, image, device):
    import superneurons as sn
    torch.manual_seed(0)
    began = time.perf_counter()
    model = sn.models.resnet(blocks=(3, 4, n3, 3))             # built in host memory
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, 3, image, image, generator=g).to(device)
    y = torch.randint(0, 1000, (batch,), generator=g).to(device)
    row = {"n3": n3, "depth": 3 * (n3 + 10) + 2, "batch_per_rank": batch, "image": image,
           "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
           "build_s": time.perf_counter() - began}
    return model, x, y, row


def _timed_steps(torch, dist, device, step, row, world, batch, stats=None):
    from common import rss_bytes
    cuda = device.type == "cuda"
    rows = []
    for _ in range(STEPS):
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        dist.barrier()
        began = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()                       # a step ends when the slowest rank's does
        seconds = time.perf_counter() - began
        one = {"seconds": seconds, "images_per_s": world * batch / seconds,
               "host_rss_bytes": rss_bytes()}
        if cuda:
            one["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        if stats is not None:
            s = stats()
            one.update(state_moved_bytes=s.state_moved_bytes,
                       cache_moved_bytes=s.offloaded_bytes + s.prefetched_bytes)
        rows.append(one)
        print(json.dumps(one), flush=True)
    row["steps"] = rows
    steady = rows[1:] or rows
    row["images_per_s"] = world * batch * len(steady) / sum(r["seconds"] for r in steady)


def _deep_rank(rank, world, init_file, cuda, options):
    """A throughput rank's start: its process group, the cap, the deep model and its batch."""
    torch, dist, device = _setup(rank, world, init_file, cuda)
    if cuda:
        _cap(torch, device)
    model, x, y, row = _deep(torch, rank, options["n3"], options["batch"], options["image"],
                             device)
    return torch, dist, device, model, x, y, row


def throughput_rank(rank, world, init_file, cuda, options):
    torch, dist, device, model, x, y, row = _deep_rank(rank, world, init_file, cuda, options)
    import superneurons as sn
    began = time.perf_counter()
    group = dist.group.WORLD if world > 1 else None
    wrapped = sn.wrap(model, policy="superneurons", budget=BUDGET if cuda else None,
                      state="host", device=device, process_group=group)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    row.update(world=world, wrap_s=time.perf_counter() - began)

    def step():
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(wrapped(x), y).backward()
        optimizer.step()
    try:
        _timed_steps(torch, dist, device, step, row, world, options["batch"],
                     lambda: wrapped.stats)
    except (torch.OutOfMemoryError, RuntimeError, ValueError) as error:
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:400]}"
    return row


def fsdp_rank(rank, world, init_file, cuda, options):
    torch, dist, device, model, x, y, row = _deep_rank(rank, world, init_file, cuda, options)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from common import CheckpointBlocks, _Checkpointed
    variant = options["variant"]
    row.update(world=world, variant=variant)
    began = time.perf_counter()
    mesh = init_device_mesh(device.type, (world,))
    shard = {"mesh": mesh}
    if "offload" in variant:                 # sharded state in host memory, stepped there
        shard["offload_policy"] = CPUOffloadPolicy(pin_memory=cuda)
    root = CheckpointBlocks(model)           # torch.utils.checkpoint around every block
    try:
        for module in root.modules():
            if isinstance(module, _Checkpointed):
                fully_shard(module, **shard)
        fully_shard(root, **shard)
        row["shard_s"] = time.perf_counter() - began
        optimizer = torch.optim.SGD(root.parameters(), lr=1e-3, momentum=0.9)

        def step():
            optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(root(x), y).backward()
            optimizer.step()
        _timed_steps(torch, dist, device, step, row, world, options["batch"])
    except (torch.OutOfMemoryError, RuntimeError, ValueError) as error:
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:400]}"
    return row


# -- driver -----------------------------------------------------------------------------------
CASES = {"exact": exact_rank, "throughput": throughput_rank, "fsdp": fsdp_rank}


def _rank_main(rank, case, world, init_file, out_dir, cuda, options):
    try:
        result = CASES[case](rank, world, init_file, cuda, options)
    except Exception as error:
        result = {"error": f"{type(error).__name__}: {str(error)[:400]}",
                  "traceback": traceback.format_exc()[-2000:]}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


def launch(case: str, world: int, cuda: bool, options: dict, timeout: float) -> dict:
    """One case in ``world`` fresh processes; their results by rank (a rank that did not
    finish within ``timeout`` says so)."""
    import torch.multiprocessing as mp
    os.environ.update(SAFE_ENVIRONMENT)
    began = time.time()
    with tempfile.TemporaryDirectory() as folder:
        context = mp.start_processes(
            _rank_main, args=(case, world, os.path.join(folder, "init"), folder, cuda, options),
            nprocs=world, join=False, start_method="spawn")
        try:
            while not context.join(timeout=max(1.0, timeout - (time.time() - began))):
                if time.time() - began >= timeout:
                    break
        except Exception as error:           # a rank died (killed, a CUDA fault)
            print(f"{case}: {type(error).__name__}: {str(error)[:300]}", flush=True)
        for process in context.processes:
            if process.is_alive():
                process.terminate()
                process.join(30)
        ranks = []
        for rank in range(world):
            path = os.path.join(folder, f"rank{rank}.json")
            ranks.append(json.load(open(path)) if os.path.exists(path) else
                         {"error": f"no result within {timeout:.0f} s"})
    return {"case": case, "world": world, "options": options, "ranks": ranks,
            "process_s": time.time() - began}


def run(case: str, device: str, options: dict, timeout: float) -> list:
    cuda = device == "cuda"
    if case == "exact":
        return [launch("exact", 2, cuda, options, timeout)]
    if case == "throughput":
        rows = [launch("throughput", 2, cuda, options, timeout)]
        if options["single"]:
            rows.append(launch("throughput", 1, cuda, options, timeout))
        return rows
    rows = []
    for variant in options["variants"]:      # fsdp: from the largest batch down
        for batch in options["batches"]:
            row = launch("fsdp", 2, cuda, {**options, "variant": variant, "batch": batch},
                         timeout)
            rows.append(row)
            print(json.dumps({"variant": variant, "batch": batch,
                              "errors": [r.get("error") for r in row["ranks"]]}), flush=True)
            if not any("error" in r for r in row["ranks"]):
                break
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--models", nargs="*", default=["resnet", "hf_gpt2"])
    parser.add_argument("--n3", type=int, default=1200)
    parser.add_argument("--batch", type=int, default=16, help="per GPU")
    parser.add_argument("--batches", type=int, nargs="*", default=[16, 8, 4, 2])
    parser.add_argument("--variants", nargs="*", default=["checkpoint", "checkpoint+offload"])
    parser.add_argument("--image", type=int, default=224)
    parser.add_argument("--single", action="store_true", help="throughput: one GPU alone too")
    parser.add_argument("--timeout", type=float, default=540)
    args = parser.parse_args(argv)
    if args.device == "cuda":
        import torch
        if torch.cuda.device_count() < 2:
            raise SystemExit("state_tier_ddp.py needs two GPUs (or --device cpu)")
    options = {"models": args.models, "n3": args.n3, "batch": args.batch, "image": args.image,
               "single": args.single, "batches": args.batches, "variants": args.variants}
    rows = run(args.case, args.device, options, args.timeout)
    from common import environment, write
    suffix = "" if args.device == "cuda" else "_cpu"
    path = os.path.join(args.out, f"state_tier_ddp_{args.case}{suffix}.json")
    write(path, {"command": " ".join(sys.argv), "environment": environment(),
                 "cap_gib": CAP_GIB, "budget": BUDGET, "steps": STEPS, "results": rows})
    return path


if __name__ == "__main__":
    main()
