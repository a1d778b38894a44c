"""sn.wrap(..., strict_budget=True), the budget as the allocator's limit
(runtime/allocator_cap.py), against the default, the budget held at layer boundaries: each
step's peak allocated and reserved bytes beside the budget, the allocator's out-of-memory
retries, and the speed, with the limit and without.

    python benchmarks/budget_cap.py OUT.json MODEL:DTYPE:RATIO [...] [--steps 8]

Each config runs as ratio.py runs a superneurons row (ratio.prepare: its model, batch, AdamW,
the cap at RATIO of the plain peak recorded in results/ratio_MODEL_DTYPE.json, the budget
CAP_HEADROOM below it), one fresh process per config and switch, one process at a time. The
first two steps are warm-up; speed is the median of the rest.
"""

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WARMUP = 2


def child(name: str, dtype: str, ratio: float, steps: int) -> dict:
    import torch
    from common import torch_settings
    from ratio import BATCH, SEQUENCE, prepare, recorded_plain_peak
    torch_settings()                 # expandable segments, no TF32: before any CUDA work
    device = torch.device("cuda", 0)
    run, step_once, cap, _ = prepare(name, dtype, "superneurons", ratio,
                                     recorded_plain_peak(name, dtype), device)
    rows = []
    try:
        for _ in range(steps):
            before = torch.cuda.memory_stats(device)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
            began = time.perf_counter()
            step_once()
            torch.cuda.synchronize()
            after = torch.cuda.memory_stats(device)
            stats = run.stats
            rows.append({
                "seconds": time.perf_counter() - began,
                "peak_allocated_bytes": after["allocated_bytes.all.peak"],
                "peak_reserved_bytes": after["reserved_bytes.all.peak"],
                "ooms": after["num_ooms"] - before["num_ooms"],
                "alloc_retries": after["num_alloc_retries"] - before["num_alloc_retries"],
                "moved_bytes": stats.offloaded_bytes + stats.prefetched_bytes,
                "recomputed_layers": stats.recomputed_layers})
    except (torch.OutOfMemoryError, RuntimeError, ValueError) as error:
        return {"ok": False, "error": f"{type(error).__name__}: {str(error)[:300]}",
                "steps": rows}
    budget = run.budget_bytes
    steady = sorted(r["seconds"] for r in rows[WARMUP:])
    samples = BATCH[name] * (SEQUENCE if name == "gpt2" else 1)
    return {"ok": True, "budget_bytes": budget, "cap_bytes": cap,
            "per_s": samples / steady[len(steady) // 2],
            "max_peak_allocated_bytes": max(r["peak_allocated_bytes"] for r in rows),
            "steps_over_budget": sum(r["peak_allocated_bytes"] > budget for r in rows),
            "steps": rows}


def main():
    if sys.argv[1] == "--child":
        name, dtype, ratio, steps = sys.argv[2:6]
        print(json.dumps(child(name, dtype, float(ratio), int(steps))), flush=True)
        return
    sys.path.insert(0, HERE)
    from common import run_child, write
    out, configs = sys.argv[1], [a for a in sys.argv[2:] if ":" in a]
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 8
    record = {"warmup_steps": WARMUP, "rows": []}
    for config in configs:
        name, dtype, ratio = config.split(":")
        for switch in ("1", "0"):
            row = run_child([sys.executable, __file__, "--child", name, dtype, ratio, str(steps)],
                            300, cwd=HERE, env={**os.environ, "RATIO_STRICT_BUDGET": switch})
            row = {"model": name, "dtype": dtype, "ratio": float(ratio),
                   "strict_budget": switch == "1", **row}
            record["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "steps"}), flush=True)
            write(out, record, quiet=True)


if __name__ == "__main__":
    main()
