"""What a plan holds at its peak step: the buffers live there (activations, gradients, saved
tensors, scratch), to set against the allocator's trace of the same step on the device
(diagnose_peak.py). The planner on the meta device; the budget as claims.py gives it, less the
optimizer's momentum and what PyTorch keeps on the device (claim_batches.py's figures).

    python benchmarks/plan_at_peak.py OUT.json --network densenet201:799 [--budget-gib 11.5]
        [--others-bytes N]   (CPU)
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write  # noqa: E402
import superneurons as sn  # noqa: E402
from superneurons import models  # noqa: E402

# what PyTorch keeps on the H200 after a step besides the model (claim_batches.json)
OTHERS_BYTES = 68_380_536


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--network", default="densenet201:799")
    parser.add_argument("--budget-gib", type=float, default=11.5)
    parser.add_argument("--others-bytes", type=int, default=OTHERS_BYTES)
    args = parser.parse_args()
    name, batch = args.network.split(":")
    model = models.build(name, num_classes=1000)
    momentum = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = int(args.budget_gib * 2**30) - momentum - args.others_bytes
    plan = sn.plan(model, models.input_shape(name, int(batch), None), policy="superneurons",
                   budget=budget)
    peak = max(plan.steps, key=lambda step: step.live_bytes)
    live = [{"label": b.label, "bytes": b.nbytes, "managed": b.managed,
             "intervals": [list(i) for i in b.intervals]}
            for b in plan.buffers if b.live_at(peak.index)]
    write(args.out, {"network": args.network, "budget_bytes": budget,
                     "momentum_bytes": momentum, "others_bytes": args.others_bytes,
                     "peak_bytes": plan.peak_bytes, "resident_bytes": plan.resident_bytes,
                     "peak_step": {"index": peak.index, "phase": peak.phase,
                                   "layer": peak.layer, "live_bytes": peak.live_bytes},
                     "live_at_peak": sorted(live, key=lambda b: -b["bytes"])})


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
