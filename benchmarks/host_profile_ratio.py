"""Where the host's time goes in a capped step, as ratio.py runs it: Python's profiler over a few
steps after superneurons has timed its plans (module Rule 10), the functions with the most time
of their own. The device's side is profile_ratio.py's.

    python benchmarks/host_profile_ratio.py OUT_DIR MODEL:DTYPE:RATIO [--steps 5] [--top 30]
        [--gc-freeze]

The cap is RATIO of the plain peak in results/ratio_MODEL_DTYPE.json. With --gc-freeze, the
steps are timed again after gc.freeze() (Python's collector then passes over every object made
so far, the captured graphs' among them), before the profiled ones. Writes
OUT_DIR/host_profile_ratio.json.
"""

import argparse
import cProfile
import gc
import os
import pstats
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SETTLING = 24            # steps before profiling: calibration and the trial of plans


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("config")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--gc-freeze", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    sys.path.insert(0, HERE)
    import torch
    from common import torch_settings, write
    from ratio import prepare, recorded_plain_peak
    torch_settings()
    name, dtype, ratio = args.config.split(":")
    device = torch.device("cuda", 0)
    run, step, _, _ = prepare(name, dtype, "superneurons", float(ratio),
                              recorded_plain_peak(name, dtype), device)
    for _ in range(SETTLING):
        step()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    unprofiled = (time.perf_counter() - began) / args.steps
    frozen = None
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
        began = time.perf_counter()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        frozen = (time.perf_counter() - began) / args.steps
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = sorted(((own, total, calls, f"{os.path.basename(file)}:{line}({function})")
                   for (file, line, function), (_, calls, own, total, _) in stats.stats.items()),
                  reverse=True)[:args.top]
    write(os.path.join(args.out, "host_profile_ratio.json"), {
        "config": args.config, "steps": args.steps, "unprofiled_step_s": unprofiled,
        "gc_frozen_step_s": frozen,
        "profiled_step_s": stats.total_tt / args.steps, "stats": run.stats.as_dict(),
        "top_by_own_time": [{"function": where, "own_s_per_step": own / args.steps,
                             "total_s_per_step": total / args.steps,
                             "calls_per_step": calls / args.steps}
                            for own, total, calls, where in rows]})


if __name__ == "__main__":
    main()
