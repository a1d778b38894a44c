"""The largest batch whose plan still fits the budget once the optimizer has state: a planner
question, answered on the meta device (no GPU). SGD with momentum keeps one buffer per
parameter from its first step on, and the wrapper then plans the step again within what the
budget leaves (module Rule 3), so a batch trains at steady state only if the policy's floor
fits the budget less the momentum buffers and what PyTorch itself keeps on the device.

    python benchmarks/claim_batches.py OUT [--networks ...] [--budget-gib 11.5]

Writes OUT/claim_batches.json: per network, the one-step largest (floor within the budget) and
the steady-state largest (floor within the budget less momentum and the executor's slack), by
bisection on batch size. ``--resnet-depth-batch B`` and ``--densenet-depth-batch B`` ask the
same of the depth benchmarks' bottleneck ResNet [3, 4, n, 3] (common.make_deep_resnet) and
DenseNet-BC (k=12, 32 px images, depth 6n + 4) at batch B, by bisection on n (momentum grows
with n too). The slack is what the executor leaves beside a calibrated plan for real
use between layer boundaries (calibration.SLACK_SHARE): a floor that fills it passed the budget
(AlexNet at 2171 by 4 MiB, claims_0495cd2.json).
"""

import argparse
import functools
import os
import sys
import time

import torch

import superneurons as sn
from superneurons import models
from superneurons.runtime.calibration import SLACK_SHARE

# what else stays allocated on the device after a step besides momentum (cuBLAS's and cuDNN's
# workspaces PyTorch keeps, the labels): foreign bytes less momentum in step 2 of DenseNet-201
# and VGG16 (benchmarks/results/claims_high_water_calibration.json: 68,380,536 and 68,161,728)
OTHERS_BYTES = 68_380_536
NETWORKS = ("resnet50", "resnet101", "resnet152", "densenet201", "inception_v4", "vgg16",
            "alexnet")


def floor_bytes(network: str, batch: int) -> int:
    model = models.build(network)
    return sn.plan(model, models.input_shape(network, batch), policy="superneurons").peak_bytes


def deep_resnet(n3: int) -> torch.nn.Module:
    with torch.device("meta"):
        return models.resnet(blocks=(3, 4, n3, 3))


def densenet_bc(n: int) -> torch.nn.Module:
    with torch.device("meta"):
        return models.densenet(6 * n + 4, 12, cifar=True)


def momentum_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


# name -> (model of n blocks, input shape at a batch, depth of n blocks, bisection's first n)
DEEP = {"resnet_depth": (deep_resnet, lambda b: (b, 3, 224, 224), lambda n: 3 * (n + 10) + 2, 64),
        "densenet_bc_depth": (densenet_bc, lambda b: (b, 3, 32, 32), lambda n: 6 * n + 4, 256)}


def probed(network: str, batch: int, budget: int, slack: int, blocks: list) -> dict:
    """Whether ``network`` (DEEP) fits one step and beside momentum at each block count in
    ``blocks``: the steady test of deepest() at chosen points, without its bisection (a
    DenseNet-BC of 6,000 layers takes a minute to plan)."""
    build, shape, depth, _ = DEEP[network]
    rows = []
    for n in blocks:
        floor = sn.plan(build(n), shape(batch), policy="superneurons").peak_bytes
        momentum = momentum_bytes(build(n))
        rows.append({"n": n, "depth": depth(n), "floor_bytes": floor, "momentum_bytes": momentum,
                     "one_step_fits": floor <= budget,
                     "steady_fits": floor + momentum + OTHERS_BYTES + slack <= budget})
        print(rows[-1], flush=True)
    return {"network": network, "batch": batch, "others_bytes": OTHERS_BYTES,
            "slack_bytes": slack, "probes": rows}


def one_step_and_steady(floor, beside, budget: int, low: int, largest, **bisection) -> tuple:
    """(the largest n whose ``floor(n)`` fits the budget, the largest whose floor fits beside
    ``beside(n)``: momentum, the others and the slack), by bisection (tolerance 0)."""
    one_step, _ = largest(lambda n: floor(n) <= budget, low=low, tolerance=0, **bisection)
    if not one_step:
        return 0, 0
    steady, _ = largest(lambda n: floor(n) + beside(n) <= budget, low=max(1, one_step // 2),
                        bound=one_step + 1, tolerance=0, **bisection)
    return one_step, steady


def deepest(network: str, batch: int, budget: int, slack: int, largest) -> dict:
    """The deepest ``network`` (DEEP) whose floor fits at ``batch``: one step, and beside
    momentum (steady), by bisection on its block count n."""
    build, shape, depth, low = DEEP[network]
    floor = functools.cache(
        lambda n: sn.plan(build(n), shape(batch), policy="superneurons").peak_bytes)
    # no probes above the bisection's result: fitting grows monotone with the blocks here, and a
    # DenseNet-BC of 6,000 layers takes a minute to plan
    one_step, steady = one_step_and_steady(
        floor, lambda n: momentum_bytes(build(n)) + OTHERS_BYTES + slack, budget, low, largest,
        look_above=())
    if not one_step:
        return {"network": network, "batch": batch, "one_step_n": 0, "steady_n": 0}
    return {"network": network, "batch": batch, "others_bytes": OTHERS_BYTES,
            "slack_bytes": slack, "one_step_n": one_step, "one_step_depth": depth(one_step),
            "one_step_floor_bytes": floor(one_step), "steady_n": steady,
            "steady_depth": depth(steady), "steady_floor_bytes": floor(steady),
            "steady_momentum_bytes": momentum_bytes(build(steady))}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--networks", nargs="*", default=list(NETWORKS))
    parser.add_argument("--budget-gib", type=float, default=11.5)
    parser.add_argument("--resnet-depth-batch", type=int, default=None,
                        help="also the deepest ResNet [3, 4, n, 3] at this batch")
    parser.add_argument("--densenet-depth-batch", type=int, default=None,
                        help="also the deepest DenseNet-BC (k=12, 32 px) at this batch")
    parser.add_argument("--depth-probes", type=int, nargs="*", default=None, metavar="N",
                        help="with a depth batch: test these block counts, no bisection")
    args = parser.parse_args()
    depth_batches = [b for b in (args.resnet_depth_batch, args.densenet_depth_batch) if b]
    if args.depth_probes is not None and len(depth_batches) != 1:
        parser.error("--depth-probes tests the block counts of one depth network: give "
                     "--resnet-depth-batch or --densenet-depth-batch, one of them")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import largest, write
    budget = int(args.budget_gib * 2**30)
    slack = int(budget * SLACK_SHARE)
    rows = []
    for network in args.networks:
        began = time.perf_counter()
        with torch.device("meta"):
            momentum = momentum_bytes(models.build(network))
        floor = functools.cache(lambda batch, network=network: floor_bytes(network, batch))
        one_step, steady = one_step_and_steady(
            floor, lambda batch: momentum + OTHERS_BYTES + slack, budget, 64, largest)
        rows.append({"network": network, "momentum_bytes": momentum, "others_bytes": OTHERS_BYTES,
                     "slack_bytes": slack,
                     "one_step_batch": one_step, "one_step_floor_bytes": floor(one_step),
                     "steady_batch": steady, "steady_floor_bytes": floor(steady),
                     "seconds": time.perf_counter() - began})
        print(rows[-1], flush=True)
        write(os.path.join(args.out, "claim_batches.json"),
              {"command": " ".join(sys.argv), "budget_bytes": budget, "results": rows},
              quiet=True)
    for network, batch in (("resnet_depth", args.resnet_depth_batch),
                           ("densenet_bc_depth", args.densenet_depth_batch)):
        if batch:
            began = time.perf_counter()
            rows.append(deepest(network, batch, budget, slack, largest)
                        if args.depth_probes is None else
                        probed(network, batch, budget, slack, args.depth_probes))
            rows[-1]["seconds"] = time.perf_counter() - began
            print(rows[-1], flush=True)
    write(os.path.join(args.out, "claim_batches.json"),
          {"command": " ".join(sys.argv), "budget_bytes": budget, "results": rows})


if __name__ == "__main__":
    main()
