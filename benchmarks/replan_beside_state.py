"""A plan chosen to move nothing, made before the optimizer's first step, beside that state
(module Rule 3): GPT-2 small under bf16 autocast at 0.75 of plain PyTorch's peak, as ratio.py
ran it on the H200 (its budget, the AdamW state and the calibrated excess read from
results/ratio_gpt2_bf16_3fc19e0.json), planned on the CPU. Per plan: the bytes the Tensor Cache
would move a step beside the state (and the excess), and the replays' estimated seconds.

    python benchmarks/replan_beside_state.py OUT_DIR      (CPU: OUT_DIR/replan_beside_state.json)
"""

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
RECORD = os.path.join(HERE, "results", "ratio_gpt2_bf16_3fc19e0.json")


def main():
    import superneurons as sn
    from common import write
    from gpt2_floor import model_and_call
    from superneurons.planner.trim import replay_work
    from superneurons.runtime import module
    ran = next(r for r in json.load(open(RECORD))["rows"]
               if r.get("system") == "superneurons" and r.get("ratio") == 0.75)
    budget = ran["first_step"]["budget_bytes"]
    later = ran["steps"][-1]
    state, excess = later["foreign_bytes"], later["excess_bytes"]
    model, call = model_and_call("cpu")
    rows = []
    for made, left in (("before the optimizer's state", budget),
                       ("beside it (module Rule 3)",
                        budget - state - budget // module.REPLAN_SLACK)):
        plan = sn.plan(model, (), "superneurons", budget=left, kwargs=call,
                       autocast=torch.bfloat16)
        rows.append({"made": made, "budget_bytes": left, "peak_bytes": plan.peak_bytes,
                     "recomputed_layers": plan.num_extra_computations,
                     "replay_seconds": replay_work(plan),
                     "moved_at_its_budget": plan.bytes_to_move(left),
                     "moved_beside_state": plan.bytes_to_move(budget - state),
                     "moved_beside_state_and_excess": plan.bytes_to_move(budget - state - excess)})
        print(rows[-1], flush=True)
    write(os.path.join(sys.argv[1], "replan_beside_state.json"), {
        "command": "python benchmarks/replan_beside_state.py " + " ".join(sys.argv[1:]),
        "from_record": os.path.basename(RECORD), "budget_bytes": budget,
        "state_bytes": state, "excess_bytes": excess,
        "measured_moved_bytes_a_step": later["moved_bytes"], "rows": rows})


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()
