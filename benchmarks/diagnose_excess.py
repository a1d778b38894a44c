"""Where real use differs from the plan (executor Rule 4): per layer boundary of the calibrating
steps, real use less the plan's count (the excess the calibration reads where positive; where
negative, room the plan counted and the step did not use), and at the largest excess the
allocator's live blocks grouped by where they were made; then what the later steps moved and
took, and the plan then running against its alternatives (their peaks with every checkpoint
kept, and their replays' seconds at the machine's rates).

    python benchmarks/diagnose_excess.py OUT_DIR MODEL:DTYPE:RATIO [...]

Runs as ratio.py runs a superneurons row (ratio.prepare: its model, batch, cap at RATIO of the
plain peak recorded in results/ratio_MODEL_DTYPE.json, AdamW), one fresh process per config; writes
OUT_DIR/diagnose_excess_MODEL_DTYPE_RATIO.json.
"""

import os
import subprocess
import sys
import time
from collections import defaultdict

from snapshot_peak import live_blocks

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 6


def child(name: str, dtype: str, ratio: float, out: str) -> None:
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch
    from superneurons.runtime import calibration
    from common import torch_settings, write
    from ratio import prepare, recorded_plain_peak
    torch_settings()
    device = torch.device("cuda", 0)
    run, step_once, cap, (args, kwargs) = prepare(
        name, dtype, "superneurons", ratio, recorded_plain_peak(name, dtype), device)
    readings, state = defaultdict(list), {"step": 0, "snap_at": None, "snapshot": None}
    observe = calibration.Calibration.observe

    def recording(self, step, others, planned, pool):
        if state["step"] == 1 and step == state["snap_at"] and state["snapshot"] is None:
            state["snapshot"] = {"timeline_step": step, "planned": planned, "pool": pool,
                                 "others": others, "allocated": self.read(),
                                 "blocks": live_blocks(("torch/", "torchvision"), 25)}
        readings[state["step"]].append(
            (step, self.read() - others - pool - planned, planned, pool))
        return observe(self, step, others, planned, pool)

    calibration.Calibration.observe = recording
    steps = []
    for index in range(STEPS):
        state["step"] = index
        if index == 1:
            excess = [r[1] for r in readings[0]]
            state["snap_at"] = readings[0][excess.index(max(excess))][0]
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        began = time.perf_counter()
        step_once()
        torch.cuda.synchronize()
        if index == 1:
            torch.cuda.memory._record_memory_history(enabled=None)
        stats = run.stats
        steps.append({"seconds": time.perf_counter() - began,
                      "peak_allocated": torch.cuda.max_memory_allocated(device),
                      "offloaded": stats.offloaded_bytes, "prefetched": stats.prefetched_bytes,
                      "recomputed_layers": stats.recomputed_layers})
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "bf16"):   # the steps'
        plan, executor = run.plan_for(*args, **kwargs)
    layer_of_step = {}
    for position, layer in enumerate(plan.order):
        layer_of_step[position] = plan.graph.layers[layer].name
        layer_of_step[executor.bwd(layer)] = "backward " + plan.graph.layers[layer].name
    from superneurons.planner.trim import replay_work
    plans = [{"replayed_layers": option.num_extra_computations,
              "replay_seconds": replay_work(option),
              "kept_peak_bytes": max(option._kept_live, default=0)}
             for option in (plan, *plan.alternatives)]
    record = {"model": name, "dtype": dtype, "ratio": ratio, "cap_bytes": cap,
              "budget_bytes": executor.budget_bytes, "predicted_peak_bytes": plan.peak_bytes,
              "excess_bytes": executor.excess_bytes, "steps": steps,
              "foreign_bytes": executor.foreign_bytes, "plans": plans,
              "snapshot": state["snapshot"],
              "readings": {str(step): [[s, layer_of_step.get(s, "?"), e, p, q]
                                       for s, e, p, q in rows]
                           for step, rows in readings.items()}}
    write(out, record)


def main():
    if sys.argv[1] == "--child":
        name, dtype, ratio, out = sys.argv[2:6]
        return child(name, dtype, float(ratio), out)
    out_dir = sys.argv[1]
    for config in sys.argv[2:]:
        name, dtype, ratio = config.split(":")
        out = os.path.join(out_dir, f"diagnose_excess_{name}_{dtype}_{ratio}.json")
        done = subprocess.run([sys.executable, __file__, "--child", name, dtype, ratio, out],
                              cwd=HERE, capture_output=True, text=True, timeout=400)
        print(config, done.returncode, done.stderr[-1500:], flush=True)


if __name__ == "__main__":
    main()
