"""What the planner predicts a larger spare share of the budget would cost (CPU, no device):
for each superneurons row of ratio.py records, the plan at that row's budget (less AdamW's
state, which the runtime plans beside) and the row's measured device rates, with trim's
PLANNED_SHARE at each share: layers replayed, the replays' predicted seconds, and bytes the
plan moves. The rows' measured replays, bytes moved and speed stand beside them.

The executor leaves calibration.SLACK_SHARE of the budget and the calibrated excess beside the
plan, so a plan that fits PLANNED_SHARE with nothing moved still moves data where those pass
the share it leaves; this shows what leaving more would cost in replays, for an A/B on the
device (benchmarks/planned_share/, SN_PLANNED_SHARE).

    python benchmarks/planned_share.py OUT_DIR [RATIO_RECORD ...]
        (CPU; writes OUT_DIR/planned_share.json; by default the ratio_*_pace_at_moves.json)
"""

import glob
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHARES = (0.97, 0.95, 0.93, 0.90)
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def planned(record: dict, row: dict, share: float) -> dict:
    import importlib
    import torchvision
    from superneurons.planner import H200, plan, trim
    plan_module = importlib.import_module("superneurons.planner.plan")   # plan() shadows it
    rates = row["machine"]
    machine = replace(H200, memory_bytes_per_s=rates["memory_bytes_per_s"],
                      conv_flops_per_s=rates["conv_flops_per_s"],
                      matmul_flops_per_s=rates["matmul_flops_per_s"],
                      link_bytes_per_s=rates["link_bytes_per_s"], source=rates["source"])
    model = torchvision.models.get_model(record["model"], weights=None)
    budget = row["first_step"]["budget_bytes"] - 2 * sum(
        p.numel() * p.element_size() for p in model.parameters())       # AdamW's two moments
    before, trim.PLANNED_SHARE = trim.PLANNED_SHARE, share
    plan_module.PLANNED_SHARE = share
    try:
        made = plan(model, torch.empty(record["batch"], 3, 224, 224, device="meta"),
                    "superneurons", budget, machine=machine,
                    autocast=torch.bfloat16 if record["dtype"] == "bf16" else None)
    finally:
        trim.PLANNED_SHARE = plan_module.PLANNED_SHARE = before
    return {"share": share, "replayed_layers": made.num_extra_computations,
            "replay_s": trim.replay_work(made), "bytes_to_move": made.bytes_to_move()}


def main():
    import json
    from common import write
    out, paths = sys.argv[1], sys.argv[2:] or sorted(
        glob.glob(os.path.join(RESULTS, "ratio_*_pace_at_moves.json")))
    rows = []
    for path in paths:
        with open(path) as file:
            record = json.load(file)
        for row in record["rows"]:
            if row["system"] != "superneurons" or not row["ok"]:
                continue
            rows.append({"record": os.path.basename(path), "model": record["model"],
                         "dtype": record["dtype"], "ratio": row["ratio"],
                         "measured": {"recomputed_layers": row["recomputed_layers"],
                                      "moved_bytes": row["moved_bytes"],
                                      "of_plain": row["of_plain"]},
                         "plans": [planned(record, row, share) for share in SHARES]})
            print(json.dumps(rows[-1]), flush=True)
    write(os.path.join(out, "planned_share.json"), {"shares": SHARES, "rows": rows})


if __name__ == "__main__":
    main()
