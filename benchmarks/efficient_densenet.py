"""The memory-efficient DenseNet on CUDA: exactness, memory per depth, time against plain.

    python benchmarks/efficient_densenet.py OUT_DIR [--depths 100 250 ...] [--systems ...]
        [--seconds S] [--no-exact] [--no-cudnn-benchmark] [--tag SUFFIX]

DenseNet-BC (k=12, batch 64, 32 px, SGD with momentum) under a 12 GiB cap:
- exact: plain against plain (the control), the shared-storage DenseNet alone and under
  sn.wrap (superneurons, a budget below the liveness peak), 3 steps, deterministic kernels;
- per depth and system, the peak allocated in the second step (momentum exists) and the
  median step seconds of the steps after it; a system out of memory at a depth is left out at
  the depths above. Systems: plain; torchvision's DenseNet with memory_efficient=True
  (checkpointing of each layer's concat-BN-ReLU-conv1x1) and the CIFAR stem; efficient (this
  project's shared storage, unwrapped); superneurons (sn.wrap of the plain DenseNet, policy
  recompute, no budget: its planner's recomputation at its floor); superneurons_equal (sn.wrap
  of the plain DenseNet, policy superneurons, budget the peak the efficient system reached at
  that depth: the two at equal memory).
Writes OUT_DIR/efficient_densenet.json after every measurement.
"""

import argparse
import gc
import os
import statistics
import sys
import time

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import superneurons as sn  # noqa: E402
from superneurons import models  # noqa: E402
from common import cap_memory, write  # noqa: E402

BATCH, IMAGE, GROWTH = 64, 32, 12


def torchvision_cifar(depth: int) -> nn.Module:
    """torchvision's DenseNet-BC with memory_efficient=True and the CIFAR stem (3x3, 2k)."""
    from torchvision.models import DenseNet
    n = (depth - 4) // 6
    model = DenseNet(GROWTH, (n, n, n), 2 * GROWTH, 4, 0, 10, memory_efficient=True)
    model.features.conv0 = nn.Conv2d(3, 2 * GROWTH, 3, padding=1, bias=False)
    for name in ("norm0", "relu0", "pool0"):
        setattr(model.features, name, nn.Identity())
    return model


def build(system: str, depth: int, efficient_peak: int | None = None):
    if system == "torchvision":
        model = torchvision_cifar(depth).cuda()
        return model, model, lambda out, y: F.cross_entropy(out, y)
    model = models.densenet(depth, GROWTH, cifar=True, efficient=system == "efficient").cuda()
    runner = model
    if system == "superneurons":
        runner = sn.wrap(model, policy="recompute")
    elif system == "superneurons_equal":     # the budget the shared-storage DenseNet used
        if efficient_peak is None:
            raise ValueError("superneurons_equal needs the efficient system measured before it")
        runner = sn.wrap(model, policy="superneurons", budget=efficient_peak)
    return model, runner, F.nll_loss


def steps(model, runner, loss_fn, x, y, count: int) -> list:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rows = []
    for _ in range(count):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        began = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(runner(x), y)
        loss.backward()
        optimizer.step()
        torch.cuda.synchronize()
        rows.append({"seconds": time.perf_counter() - began, "loss": loss.item(),
                     "peak_allocated_bytes": torch.cuda.max_memory_allocated()})
    return rows


def data(seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(BATCH, 3, IMAGE, IMAGE, device="cuda", generator=generator),
            torch.randint(0, 10, (BATCH,), device="cuda", generator=generator))


def exactness(depth=100) -> dict:
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    x, y = data()
    results, reference = {}, None
    for name in ("plain", "plain again", "efficient", "efficient under sn.wrap"):
        torch.manual_seed(0)
        model = models.densenet(depth, GROWTH, cifar=True,
                                efficient=name.startswith("efficient")).cuda()
        runner = model
        if name == "efficient under sn.wrap":
            live = sn.plan(model, x, policy="liveness").peak_bytes
            floor = sn.plan(model, x, policy="superneurons").peak_bytes
            runner = sn.wrap(model, policy="superneurons", budget=(live + floor) // 2)
        losses = [r["loss"] for r in steps(model, runner, F.nll_loss, x, y, 3)]
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if reference is None:
            reference = (losses, state)
            continue
        difference = max((state[k].float() - v.float()).abs().max().item()
                         for k, v in reference[1].items())
        results[name] = {"losses": losses, "reference_losses": reference[0],
                         "max_state_difference": difference,
                         "bit_identical": difference == 0.0 and losses == reference[0]}
        del model, runner
    torch.use_deterministic_algorithms(False)
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--depths", nargs="+", type=int,
                        default=[100, 250, 496, 748, 1000, 1198, 1498, 2002, 3004])
    parser.add_argument("--systems", nargs="+",
                        default=["plain", "efficient", "torchvision", "superneurons"])
    parser.add_argument("--seconds", type=float, default=480, help="stop starting work after")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no-exact", dest="exact", action="store_false")
    parser.add_argument("--no-cudnn-benchmark", dest="cudnn_benchmark", action="store_false",
                        help="memory only: autotuning every new convolution shape of a deep "
                             "DenseNet takes a minute in its first step")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    deadline = time.time() + args.seconds
    path = os.path.join(args.out, f"efficient_densenet{args.tag}.json")
    record = {"batch": BATCH, "image": IMAGE, "growth": GROWTH, "cap_gib": 12.0,
              "cudnn_benchmark": args.cudnn_benchmark}
    if args.exact:
        record["exact"] = exactness()
        print(record["exact"], flush=True)
        write(path, record)
    cap_memory(12.0)
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    record["memory"] = {s: {} for s in args.systems}
    out_of_memory = set()
    for depth in args.depths:
        for system in args.systems:
            if system in out_of_memory or time.time() > deadline:
                continue
            x, y = data()
            try:
                efficient = record["memory"].get("efficient", {}).get(depth, {})
                model, runner, loss_fn = build(system, depth,
                                               efficient.get("peak_allocated_bytes"))
                rows = steps(model, runner, loss_fn, x, y, args.steps)
                row = {"peak_allocated_bytes": rows[1]["peak_allocated_bytes"],
                       "step_seconds": statistics.median(r["seconds"] for r in rows[2:]),
                       "first_step_seconds": rows[0]["seconds"]}
            except (torch.OutOfMemoryError, RuntimeError, ValueError) as error:
                if "memory" not in str(error) and "needs at least" not in str(error):
                    raise
                row = {"error": str(error).splitlines()[0][:200]}
                out_of_memory.add(system)
            model = runner = None
            gc.collect()
            torch.cuda.empty_cache()
            record["memory"][system][depth] = row
            print(depth, system, row, flush=True)
            write(path, record, quiet=True)
    write(path, record)


if __name__ == "__main__":
    sys.exit(main())
