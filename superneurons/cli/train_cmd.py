"""superneurons train: a zoo network on synthetic data, with a progress bar and a summary."""

import time

import torch
import torch.nn.functional as F

from .. import models, wrap
from ..units import format_bytes
from .output import print_table
from .plan_cmd import add_model_arguments


def add_arguments(parser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--policy", default="superneurons",
                        help="baseline, liveness, offload, recompute, superneurons or auto")
    parser.add_argument("--budget", help="device memory for the step, e.g. 12GiB (default: the "
                                         "policy's own floor)")
    parser.add_argument("--strategy", default="cost-aware")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        choices=["cpu", "cuda"])
    parser.add_argument("--lr", type=float, default=0.01)


def _progress(total: int):
    try:
        from tqdm import tqdm
        return tqdm(total=total, unit="step")
    except ImportError:
        return None


def run(args) -> None:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda needs a CUDA build of PyTorch and a GPU; use --device cpu")
    device = torch.device(args.device)
    torch.manual_seed(0)
    classes = 10 if args.model == "densenet_cifar" else 1000
    model = models.build(args.model, depth=args.depth, growth=args.growth,
                         num_classes=classes).to(device)
    shape = models.input_shape(args.model, args.batch, args.image)
    x = torch.randn(shape, device=device)
    y = torch.randint(0, classes, (args.batch,), device=device)
    wrapped = wrap(model, policy=args.policy, budget=args.budget, strategy=args.strategy)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if torch.is_grad_enabled():
        wrapped.plan_for(x)                  # a budget too small fails here, before any step
    bar = _progress(args.steps)
    start = time.perf_counter()
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        loss = F.nll_loss(wrapped(x), y)
        loss.backward()
        optimizer.step()
        if bar is not None:
            elapsed = time.perf_counter() - start
            bar.set_postfix(loss=f"{loss.item():.3f}", img_s=f"{args.batch * (step + 1) / elapsed:.1f}",
                            peak=format_bytes(wrapped.stats.peak_bytes))
            bar.update()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    if bar is not None:
        bar.close()
    stats = wrapped.stats
    print_table(f"{args.model}, batch {args.batch}, {args.steps} steps on {device}",
                ["what", "value"], [
                    ["policy run", stats.policy],
                    ["images per second", f"{args.batch * args.steps / elapsed:.1f}"],
                    ["predicted peak", format_bytes(stats.predicted_peak_bytes)],
                    ["peak" + (" (measured)" if stats.measured else " (pool-accounted)"),
                     format_bytes(stats.peak_bytes)],
                    ["offloaded / prefetched", f"{format_bytes(stats.offloaded_bytes)} / "
                                               f"{format_bytes(stats.prefetched_bytes)}"],
                    ["cache hits / misses", f"{stats.cache_hits} / {stats.cache_misses}"],
                    ["layers recomputed", stats.recomputed_layers],
                    ["final loss", f"{loss.item():.4f}"]])
