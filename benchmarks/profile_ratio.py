"""Where a capped step's time goes, as ratio.py runs it: kernel time on the device against the
step's wall time (what the device waits for the host), kernels grouped by kind, and the host's
waits on the device.

    python benchmarks/profile_ratio.py OUT_DIR MODEL:DTYPE:RATIO[:SYSTEM] [...]

SYSTEM is superneurons (default), checkpoint, or plain (uncapped, RATIO ignored). The cap is
RATIO of the plain peak in results/ratio_MODEL_DTYPE.json. Each config runs in a fresh process:
4 steps, superneurons' more until its trial of plans is over (module Rule 10), then 2 profiled;
writes OUT_DIR/profile_ratio.json. Each row also says where the compute stream stood still, and
which copies ran meanwhile (stream_gaps.py).
"""

import json
import os
import sys
import tempfile
import time
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
WARM, PROFILED = 4, 2
TOP = 25                # the kernels with the most time a step, named: which engines ran
STACK_FRAMES = 10      # the innermost Python frames kept per wait: the runtime's, its caller's
SETTLING = 20           # at most this many more steps, until superneurons has timed its plans
KINDS = (("conv", ("conv", "cudnn", "implicit", "wgrad", "dgrad", "xmma", "sm90_xmma")),
         ("batch_norm", ("batch_norm", "bn_", "welford")),
         ("gemm", ("gemm", "cutlass", "nvjet")),
         ("copy", ("copy", "memcpy", "cat")),
         ("elementwise", ("elementwise", "vectorized", "threshold", "reduce", "fill")))
WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize",
         "cudaMemcpyAsync", "cudaStreamWaitEvent", "cudaHostAlloc", "cudaFreeHost")


def _kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, marks in KINDS if any(m in lowered for m in marks)), "other")


def profiled(step, steps: int, stacks: bool = False) -> dict:
    """``steps`` calls of ``step`` under torch.profiler: wall seconds a step, kernel seconds a
    step by kind (copies on their own streams overlap the rest, so the kinds may add up to more
    than the wall), kernels by kind, the kernels that took longest, and the host's waits on the
    device a step; with ``stacks``, the Python stacks the longest waits were called from."""
    import torch
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, with_stack=stacks) as profiler:
        began = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - began) / steps
    kernels, waits, counts = defaultdict(float), defaultdict(float), defaultdict(int)
    each = []
    for event in profiler.key_averages():
        device_us = getattr(event, "self_device_time_total", 0)
        if event.device_type == torch.autograd.DeviceType.CUDA or \
                (device_us > 0 and event.self_cpu_time_total == 0):
            kernels[_kind(event.key)] += device_us / 1e6 / steps
            counts[_kind(event.key)] += event.count
            each.append({"kernel": event.key[:120], "kind": _kind(event.key),
                         "ms": device_us / 1e3 / steps, "count": event.count / steps})
        elif event.key in WAITS:
            waits[event.key] += event.cpu_time_total / 1e6 / steps
    busy = sum(kernels.values())
    found = {"wall_s": wall, "kernel_s": busy, "device_idle_share": max(0.0, 1 - busy / wall),
             "kernel_s_by_kind": dict(kernels),
             "kernels_by_kind": {k: v // steps for k, v in counts.items()},
             "host_waits_s": dict(waits), "compute_stream": _compute_stream(profiler, steps),
             "top_kernels": sorted(each, key=lambda k: -k["ms"])[:TOP]}
    if stacks:
        found["waits_by_stack"] = _waits_by_stack(profiler, steps)
    return found


def _waits_by_stack(profiler, steps: int) -> list:
    """The host's waits on the device (and its allocations of pinned memory) grouped by the
    Python frames they were called from, the longest first."""
    waits = [{"wait": event.key, "ms": event.cpu_time_total / 1e3 / steps,
              "count": event.count / steps, "stack": list(event.stack)[:STACK_FRAMES]}
             for event in profiler.key_averages(group_by_stack_n=STACK_FRAMES)
             if event.key in WAITS and event.key != "cudaStreamWaitEvent"]
    return sorted(waits, key=lambda w: -w["ms"])[:TOP]


def _compute_stream(profiler, steps: int) -> dict:
    """stream_gaps of the profiled steps, through the Chrome trace the profiler exports."""
    from stream_gaps import stream_gaps
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        profiler.export_chrome_trace(path)
        with open(path) as f:
            return stream_gaps(json.load(f), steps)


def child(name: str, dtype: str, ratio: float, system: str) -> dict:
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch
    from common import torch_settings
    from ratio import prepare, recorded_plain_peak
    torch_settings()
    device = torch.device("cuda", 0)
    capped = system != "plain"
    run, step, _, _ = prepare(name, dtype, system, ratio if capped else None,
                              recorded_plain_peak(name, dtype) if capped else None, device)

    for _ in range(WARM):
        step()
    trying = False
    for _ in range(SETTLING if system == "superneurons" else 0):
        step()
        if trying and not run.stats.trying:
            break                                  # the step after the trial's last
        trying = run.stats.trying
    torch.cuda.synchronize()
    began = time.perf_counter()                    # the profiler adds host time to every op
    for _ in range(PROFILED):
        step()
    torch.cuda.synchronize()
    unprofiled = (time.perf_counter() - began) / PROFILED
    retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
    row = {"config": f"{name}:{dtype}:{ratio}:{system}", "unprofiled_wall_s": unprofiled,
           **profiled(step, PROFILED)}
    # the allocator's retries at the cap a profiled step: each frees its cache and waits for
    # the whole device first
    row["alloc_retries_per_step"] = (torch.cuda.memory_stats(device).get(
        "num_alloc_retries", 0) - retries) / PROFILED
    if system == "superneurons" and run.stats is not None:
        row["stats"] = run.stats.as_dict()
    return row


def main():
    if sys.argv[1] == "--child":
        name, dtype, ratio, system = sys.argv[2:6]
        print(json.dumps(child(name, dtype, float(ratio), system)))
        return
    sys.path.insert(0, HERE)
    from common import run_child, write
    rows = []
    for config in sys.argv[2:]:
        name, dtype, ratio, *system = config.split(":")
        row = run_child([sys.executable, __file__, "--child", name, dtype, ratio,
                         (system or ["superneurons"])[0]], 300, cwd=HERE)
        rows.append(row if "error" not in row else {"config": config, **row})
        print(json.dumps(rows[-1])[:400], flush=True)
        write(os.path.join(sys.argv[1], "profile_ratio.json"), {"rows": rows}, quiet=True)


if __name__ == "__main__":
    main()
