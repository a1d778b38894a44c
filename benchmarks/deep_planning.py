"""Planning a deep ResNet where its whole blocks do not fit: seconds per plan and bytes to move a
step, with the planner's cut and merged blocks (trim.split_blocks) and without them. Planner
only, on the CPU (meta tensors).

    python benchmarks/deep_planning.py OUT.json [--depth 1001] [--batch 16]
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, write  # noqa: E402

# of superneurons' floor: at it, above it where whole blocks still do not fit, and at twice it
SHARES = (1.0, 1.3, 2.0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--depth", type=int, default=1001)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    from superneurons.models.resnet import resnet
    from superneurons.planner import plan_graph, trim
    from superneurons.planner.plan import captured_step
    with torch.device("meta"):
        model = resnet(args.depth)
    graph = captured_step(model, (args.batch, 3, 224, 224))
    floor = plan_graph(graph, "superneurons").peak_bytes
    record = {**environment(), "depth": args.depth, "batch": args.batch, "floor_bytes": floor,
              "rows": []}
    split_blocks = trim.split_blocks
    for share in SHARES:
        budget = int(floor * share)
        for blocks_cut in (True, False):
            trim.split_blocks = split_blocks if blocks_cut else (lambda *_: [])
            started = time.perf_counter()
            plan = plan_graph(graph, "superneurons", budget)
            record["rows"].append({
                "share_of_floor": share, "blocks_cut_and_merged": blocks_cut,
                "plan_seconds": round(time.perf_counter() - started, 3),
                "bytes_to_move": plan.bytes_to_move(budget), "segments": len(plan.segments)})
            print(record["rows"][-1], flush=True)
    trim.split_blocks = split_blocks
    write(args.out, record)


if __name__ == "__main__":
    main()
