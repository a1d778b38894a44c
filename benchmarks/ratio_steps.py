"""What a capped step waits for, step by step: one ratio.py row in a fresh process, each step
timed twice (when the host got back from it, and when the device finished it), with Python's
collections, the caching allocator's retries and what the pool moved in it. Then the same steps
again after gc.freeze(), which leaves the collector only the objects made after it.

    python benchmarks/ratio_steps.py OUT_DIR MODEL:DTYPE:RATIO [--steps 20] [--frozen 12]
        (RATIO 0: plain PyTorch, uncapped; RATIO_CAP_SLACK=1.15 in the environment gives the
        allocator 15% more than the cap, the budget unchanged, and RATIO_HEADROOM=0.15 leaves
        15% of the cap beside the budget, as ratio.py does)

A step whose host time is close to its device time was held by the host: its Python, or a wait
for the device inside it (an allocator retry frees the cache behind a synchronization). Writes
OUT_DIR/ratio_steps_MODEL_DTYPE_RATIO.json.
"""

import argparse
import gc
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


class Collections:
    """Python's collections while it is on: (generation, seconds) each."""

    def __init__(self):
        self.seen, self._began = [], 0.0
        gc.callbacks.append(self._callback)

    def close(self) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.seen.append((info["generation"], time.perf_counter() - self._began))


def steady_summary(rows: list) -> dict:
    """Median, mean and longest step as is and after the freeze, of the steps that neither
    calibrated nor tried plans (executor Rule 4, module Rule 10), the first (capture) left out."""
    summary = {}
    for frozen in (False, True):
        steady = [r["step_s"] for index, r in enumerate(rows)
                  if r["frozen"] is frozen and index and not r.get("calibrating")
                  and not r.get("trying")]
        if steady:
            summary["frozen" if frozen else "as is"] = {
                "median_step_s": statistics.median(steady),
                "mean_step_s": statistics.mean(steady), "max_step_s": max(steady),
                "steps": len(steady)}
    return summary


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("config")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--frozen", type=int, default=12)
    args = parser.parse_args()
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    sys.path.insert(0, HERE)
    import torch
    from common import calibration_of, environment, torch_settings, write
    from ratio import CAP_SLACK, HEADROOM, prepare, recorded_plain_peak, superneurons_budget
    torch_settings()
    name, dtype, ratio = args.config.split(":")
    system = "superneurons" if float(ratio) else "plain"
    device = torch.device("cuda", 0)
    run, step, cap, _ = prepare(name, dtype, system, float(ratio) or None,
                                recorded_plain_peak(name, dtype), device)
    collections, rows = Collections(), []

    def retries() -> int:
        return torch.cuda.memory_stats(device).get("num_alloc_retries", 0)

    def timed(frozen: bool) -> None:
        collections.seen = []
        before = retries()
        torch.cuda.synchronize()
        began = time.perf_counter()
        step()
        host = time.perf_counter() - began
        torch.cuda.synchronize()
        row = {"frozen": frozen, "step_s": time.perf_counter() - began, "host_s": host,
               "collections": list(collections.seen), "allocator_retries": retries() - before}
        if system == "superneurons":
            stats = run.stats
            row.update(calibration_of(run), trying=stats.trying,
                       moved_bytes=stats.offloaded_bytes + stats.prefetched_bytes,
                       recomputed_layers=stats.recomputed_layers,
                       drained_convolutions=stats.drained_convolutions)
        rows.append(row)

    for _ in range(args.steps):
        timed(False)
    gc.collect()
    gc.freeze()
    for _ in range(args.frozen):
        timed(True)
    collections.close()
    summary = steady_summary(rows)
    print(args.config, summary)
    write(os.path.join(args.out, f"ratio_steps_{args.config.replace(':', '_')}.json"), {
        "command": " ".join(["python", "benchmarks/ratio_steps.py"] + sys.argv[1:]),
        "environment": environment(), "cap_slack": float(os.environ.get(CAP_SLACK, "1")),
        "headroom": os.environ.get(HEADROOM),
        "cap_bytes": cap, "budget_bytes": superneurons_budget(cap) if cap else None,
        "summary": summary, "rows": rows,
        "plan_trials": run.plan_trials if system == "superneurons" else None})


if __name__ == "__main__":
    main()
