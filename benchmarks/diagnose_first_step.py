"""Where a claim's first step passes its plan (executor Rule 4): per layer boundary of the
first step, the excess of real use over the plan that the calibration reads, and each time it
reaches a new high the allocator's live blocks grouped by where they were made (claims.py's
setting: the 12 GiB cap, the 11.5 GiB budget, SGD with momentum; the first step only).

    python benchmarks/diagnose_first_step.py OUT.json --network resnet101:896     (CUDA)
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from snapshot_peak import live_blocks  # noqa: E402

HIGHS_KEPT = 4


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--network", default="resnet101:896")
    args = parser.parse_args()
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch
    import superneurons as sn
    from superneurons.runtime import calibration
    from claims import BUDGET_GIB, CAP_GIB
    from common import cap_memory, make, sgd, sgd_step, write
    cap_memory(CAP_GIB)
    name, batch = args.network.split(":")
    model, x, y = make(name, int(batch), "cuda")
    wrapped = sn.wrap(model, policy="superneurons", budget=f"{BUDGET_GIB}GiB")
    plan, executor = wrapped.plan_for(x)
    highs, readings = [], []
    observe = calibration.Calibration.observe

    def recording(self, step, others, planned, pool):
        excess = max(0, self.read() - others - pool - planned)
        readings.append((step, excess, planned, pool, others))
        if excess > (highs[-1]["excess"] if highs else 0):
            highs.append({"timeline_step": step, "excess": excess, "planned": planned,
                          "pool": pool, "others": others, "blocks": live_blocks(("torch/",), 15)})
            del highs[:-HIGHS_KEPT]
        return observe(self, step, others, planned, pool)

    calibration.Calibration.observe = recording
    torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
    began = time.perf_counter()
    sgd_step(wrapped, sgd(model), x, y)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    torch.cuda.memory._record_memory_history(enabled=None)
    layer_of_step = {}
    for position, layer in enumerate(plan.order):
        layer_of_step[position] = plan.graph.layers[layer].name
        layer_of_step[executor.bwd(layer)] = "backward " + plan.graph.layers[layer].name
    for high in highs:
        high["layer"] = layer_of_step.get(high["timeline_step"], "?")
    write(args.out, {"network": args.network, "seconds": seconds,
                     "predicted_peak_bytes": plan.peak_bytes,
                     "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                     "budget_bytes": executor.budget_bytes, "highs": highs,
                     "readings": [[s, layer_of_step.get(s, "?"), e, p, q, o]
                                  for s, e, p, q, o in readings]})


if __name__ == "__main__":
    main()
