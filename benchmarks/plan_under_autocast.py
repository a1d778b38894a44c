"""sn.plan of today's models for a bf16 autocast step on CUDA, made on the CPU: the floor and the
liveness peak each policy plans, or the error. Planner only; run it with two trees on PYTHONPATH
to see what a change to capture does to these predictions (capture/entry.py traces such a plan
under the CPU's autocast since 5ac2ce9).

    PYTHONPATH=TREE python benchmarks/plan_under_autocast.py OUT.json [--against OLD.json]

The models are plan_sweep.py's (tests/today_models.py and a small U-Net), built on the CPU and
planned with autocast=torch.bfloat16, device_type="cuda". With --against, lists the models
whose floor or liveness peak changed, and any that one tree plans and the other refuses.
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
POLICIES = ("superneurons", "liveness")


def planned(name: str) -> dict:
    import torch
    import superneurons as sn
    from plan_sweep import today_model
    model, args, kwargs = today_model(name)
    row = {}
    for policy in POLICIES:
        try:
            row[policy] = sn.plan(model, args, policy, kwargs=kwargs, autocast=torch.bfloat16,
                                  device_type="cuda").peak_bytes
        except Exception as error:  # noqa: BLE001 -- recorded, the sweep goes on
            row[policy] = f"{type(error).__name__}: {str(error)[:300]}"
    return row


def main():
    sys.path.insert(0, HERE)
    from plan_sweep import TODAY, sweep_arguments
    args = sweep_arguments()
    from common import write
    record = {"models": {}}
    for name in TODAY:
        record["models"][name] = planned(name)
        print(name, record["models"][name], flush=True)
    if args.against:
        with open(args.against) as f:
            old = json.load(f)["models"]
        record["against"] = {"record": os.path.basename(args.against), "changed": {
            name: {"before": old[name], "now": now} for name, now in record["models"].items()
            if old.get(name) != now}}
    write(args.out, record)


if __name__ == "__main__":
    main()
