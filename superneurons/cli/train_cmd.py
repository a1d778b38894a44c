"""superneurons train: a zoo network or a model of today (torchvision:NAME, timm:NAME,
hf:MODEL) on synthetic data, with a progress bar and a summary."""

import argparse
import gc
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from .. import models, wrap
from ..runtime import near_limit
from ..units import format_bytes
from .output import print_table
from .plan_cmd import add_model_arguments, budget, options_refused, positive
from .progress import Progress
from .today import Named, build, is_named, settings


def add_arguments(parser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--steps", type=positive, default=10)
    parser.add_argument("--policy", default="superneurons",
                        help="baseline, liveness, offload, recompute, superneurons or auto")
    parser.add_argument("--budget", type=budget,
                        help="device memory for the step, e.g. 12GiB (default: the policy's own "
                             "floor)")
    parser.add_argument("--strategy", default="cost-aware")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        choices=["cpu", "cuda"])
    parser.add_argument("--lr", type=float,
                        help="learning rate (default: 0.01 for SGD, 0.001 for AdamW, each "
                             "PyTorch's usual order)")
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"],
                        help="SGD with momentum 0.9 (the paper's), or AdamW (its state twice "
                             "the parameters' size)")
    parser.add_argument("--bf16", action="store_true",
                        help="train under torch.autocast(dtype=torch.bfloat16) with channels_last, "
                             "the usual way on recent GPUs")
    parser.add_argument("--state", default="device", choices=["device", "host"],
                        help="where parameters, gradients and optimizer state live: host "
                             "streams them to the device layer by layer (models whose state "
                             "alone exceeds the device)")
    parser.add_argument("--nproc", type=positive, default=1,
                        help="data-parallel processes under torchrun (DistributedDataParallel; "
                             "with --state host the wrapper averages the gradients itself); "
                             "--batch is per process")


def _launch(args) -> None:
    """Start ``nproc`` copies of this command under torchrun, one per rank."""
    argv = list(args.argv)
    at = argv.index("--nproc") if "--nproc" in argv else None
    argv = argv[:at] + argv[at + 2:] if at is not None else [a for a in argv
                                                             if not a.startswith("--nproc=")]
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}   # never NVLink multicast on shared hosts
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={args.nproc}", "-m", "superneurons.cli.main", *argv]
    code = subprocess.run(command, env=env).returncode
    if code:
        raise SystemExit(code)


def run(args) -> None:
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return _launch(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda needs a CUDA build of PyTorch and a GPU; use --device cpu")
    # rank 0 shows what the library is doing (capture, planning, host memory) and a bar
    with Progress(enabled=os.environ.get("RANK", "0") == "0") as progress:
        _train(args, progress)


def _train(args, progress: Progress) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(args.device, local_rank) if args.device == "cuda" else torch.device("cpu")
    if world > 1:
        import torch.distributed as dist
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    named = _named(args, device, rank)
    model, x = named.model, named.args
    if args.bf16 and len(x) == 1 and x[0].dim() == 4:
        model, x = model.to(memory_format=torch.channels_last), \
            (x[0].to(memory_format=torch.channels_last),)

    if args.state == "host":      # the wrapper streams the state; the rank's group averages
        import torch.distributed as dist
        wrapped = wrap(model, policy=args.policy, budget=args.budget, strategy=args.strategy,
                       state="host", device=device,
                       process_group=dist.group.WORLD if world > 1 else None)
    else:
        wrapped = wrap(model, policy=args.policy, budget=args.budget, strategy=args.strategy)
    stats_of = wrapped
    if world > 1 and args.state == "device":   # each rank plans and budgets its own replica
        from torch.nn.parallel import DistributedDataParallel
        wrapped = DistributedDataParallel(
            wrapped, device_ids=[local_rank] if device.type == "cuda" else None)
    if args.optimizer == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(),
                                      lr=1e-3 if args.lr is None else args.lr)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01 if args.lr is None else args.lr,
                                    momentum=0.9)
    # under bf16 autocast the plan counts bf16 bytes (capture/autocast.py)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)
    progress.say(f"{args.model}, {named.inputs} on {device}")
    began = time.perf_counter()
    with autocast:
        # a budget too small fails here, before any step; one that the optimizer's state
        # (made by the first step) leaves too small fails before the second
        stats_of.plan_for(*x, **named.kwargs)
    progress.steps(args.steps)
    start = time.perf_counter()
    first_step_seconds = None
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        try:
            with autocast:
                out = wrapped(*x, **named.kwargs)
            loss = named.loss(out)
            loss.backward()
        except torch.OutOfMemoryError as error:  # in autograd's kernels: say what to change
            if not near_limit.reads_allocator(device):
                raise
            raise ValueError(near_limit.out_of_memory(
                device, step + 1, args.budget, error, *near_limit.peaks(device))) from error
        optimizer.step()
        elapsed = time.perf_counter() - start
        progress.step(loss=f"{loss.item():.3f}",
                      **{f"{named.unit}_s": f"{world * named.items * (step + 1) / elapsed:.1f}"},
                      peak=format_bytes(stats_of.stats.peak_bytes))
        if step == 0:
            if device.type == "cuda":
                torch.cuda.synchronize()
            # with capturing and planning, which plan_for did before the loop
            first_step_seconds = time.perf_counter() - began
            first = stats_of.stats
    if device.type == "cuda":
        torch.cuda.synchronize()
    end = time.perf_counter()
    elapsed, later_seconds = end - start, end - began - first_step_seconds
    progress.finish()                          # the bar ends before the summary
    if world > 1:
        import torch.distributed as dist
        # every rank done with its collectives, and DDP's reducer (which holds Gloo work) gone,
        # before the group: a rank once aborted at exit otherwise (a known Gloo teardown race)
        dist.barrier()
        del wrapped
        gc.collect()
        dist.destroy_process_group()
        if rank != 0:
            return
    stats = stats_of.stats
    predicted = ["predicted peak", format_bytes(stats.predicted_peak_bytes)]
    if stats.measured:                     # beside it, what the measured peak also counts
        predicted = [predicted[0] + " + what the model does not own",
                     f"{predicted[1]} + {format_bytes(stats.foreign_bytes)}"]
    print_table(f"{args.model}, {named.inputs} x {world} processes, {args.steps} steps on "
                f"{device}",
                ["what", "value"], [
                    ["policy run", stats.policy],
                    ["precision", "bf16 autocast, channels_last" if args.bf16 else "fp32"],
                    ["optimizer", "AdamW" if args.optimizer == "adamw" else "SGD, momentum"],
                    ["model state", args.state + (
                        f", {format_bytes(stats.state_moved_bytes)} moved a step"
                        if args.state == "host" else "")],
                    [f"{'tokens' if named.unit == 'tok' else 'images'} per second (all "
                     "processes)", f"{world * named.items * args.steps / elapsed:.1f}"],
                    ["first step (with capture) / later steps",
                     f"{first_step_seconds:.2f} s / " + (
                         f"{later_seconds / (args.steps - 1):.2f} s each"
                         if args.steps > 1 else "none")],
                    ["first step: capture / planning",
                     f"{first.capture_seconds:.2f} s / {first.planning_seconds:.2f} s"],
                    ["first step: device's rates / host check",
                     f"{first.machine_seconds:.2f} s / {first.host_check_seconds:.2f} s"],
                    ["first step: host memory taken / allocator read",
                     f"{first.host_memory_seconds:.2f} s / {first.calibration_seconds:.2f} s"],
                    predicted,
                    ["peak" + (" (measured)" if stats.measured else " (pool-accounted)"),
                     format_bytes(stats.peak_bytes)],
                    *([["allocator retries, last step (its limit reached)",
                        stats.allocator_retries]] if stats.measured else []),
                    ["offloaded / prefetched", f"{format_bytes(stats.offloaded_bytes)} / "
                                               f"{format_bytes(stats.prefetched_bytes)}"],
                    ["cache hits / misses", f"{stats.cache_hits} / {stats.cache_misses}"],
                    ["layers recomputed", stats.recomputed_layers],
                    ["final loss", f"{loss.item():.4f}"]])


def _named(args, device, rank: int) -> Named:
    """The model, the same initial weights on every rank, on ``device`` (on the CPU with its
    state on the host), and its inputs on ``device``, each rank its own."""
    options_refused(args)
    held = torch.device("cpu") if args.state == "host" else device
    torch.manual_seed(0)
    if is_named(args.model):
        return build(args.model, args.batch, held, image=args.image, seq=args.seq,
                     options=settings(args.set), inputs_seed=1 + rank, inputs_device=device)
    classes = 10 if args.model == "densenet_cifar" else 1000
    model = models.build(args.model, depth=args.depth, growth=args.growth,
                         num_classes=classes, efficient=args.efficient).to(held)
    torch.manual_seed(1 + rank)
    x = torch.randn(models.input_shape(args.model, args.batch, args.image), device=device)
    y = torch.randint(0, classes, (args.batch,), device=device)
    return Named(model, (x,), loss=lambda out: F.nll_loss(out.float(), y),
                 inputs=f"batch {args.batch}", items=args.batch)
