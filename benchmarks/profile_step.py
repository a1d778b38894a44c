"""Where a training step's time goes, per system: the host's dispatch time against the device's,
the allocator's retries and device (de)allocations, the synchronizing CUDA calls, the busiest
host functions.

    python benchmarks/profile_step.py OUT_DIR [CONFIG ...]

CONFIG is network:batch:cap_gib:system[:policy[:budget_gib]] (cap 0: none; the budget is the cap
less 0.5 GiB by default, none without a cap); writes OUT_DIR/profile.json.
"""

import cProfile
import gc
import io
import os
import pstats
import sys
import time

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from common import make, sgd, sgd_step, system, write  # noqa: E402

DEFAULT = ["resnet50:64:0:plain", "resnet50:64:0:checkpoint", "resnet50:64:0:superneurons:recompute",
           "resnet50:64:0:superneurons:superneurons", "resnet50:140:12:plain",
           "resnet50:140:12:superneurons:superneurons", "resnet50:280:12:checkpoint",
           "resnet50:280:12:superneurons:superneurons"]
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cudaMemcpy", "cudaMalloc", "cudaFree", "cuMemMap", "cuMemUnmap", "cuMemCreate",
              "cuMemRelease", "cudaHostAlloc", "cudaFreeHost", "cudaMemcpyAsync")
ALLOCATOR = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams",
             "num_ooms")


def profile_config(config: str) -> dict:
    network, batch, cap, name, *policy = config.split(":")
    budget = float(policy[1]) if len(policy) > 1 else float(cap) - 0.5
    batch, cap = int(batch), float(cap)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(cap * 2**30 / total if cap else 1.0)
    torch.backends.cudnn.benchmark = True
    options = {}
    if name == "superneurons":
        options = {"policy": policy[0]}
        if budget > 0:
            options["budget"] = f"{budget}GiB"
    model, x, y = make(network, batch, "cuda")
    wrapped = system(name, model, **options)
    optimizer = sgd(model)
    for _ in range(2):
        sgd_step(wrapped, optimizer, x, y)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    host, wall = [], []
    for _ in range(4):
        start = time.perf_counter()
        sgd_step(wrapped, optimizer, x, y)
        host.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        wall.append(time.perf_counter() - start)
    after = torch.cuda.memory_stats()
    row = {"config": config, "host_dispatch_s": sorted(host)[1], "step_s": sorted(wall)[1],
           "images_per_s": batch / sorted(wall)[1],
           "allocator_per_step": {k: (after.get(k, 0) - before.get(k, 0)) / 4 for k in ALLOCATOR}}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        sgd_step(wrapped, optimizer, x, y)
        torch.cuda.synchronize()
    events = prof.key_averages()
    row["cuda_calls"] = {e.key: e.count for e in events if e.key.startswith(SYNC_CALLS)}
    row["device_busy_s"] = sum(e.self_device_time_total for e in events) / 1e6
    row["kernels"] = sum(e.count for e in events if e.self_device_time_total > 0)
    row["top_host_ops"] = [(e.key, e.count, round(e.self_cpu_time_total / 1e3, 2)) for e in
                           sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]]
    if name == "superneurons":
        profiler = cProfile.Profile()
        profiler.enable()
        sgd_step(wrapped, optimizer, x, y)
        torch.cuda.synchronize()
        profiler.disable()
        row["python_profile"] = python_profile(profiler, "tottime", 18)
        row["stats"] = wrapped.stats.as_dict()
        row["extra_computations"] = wrapped.plan_for(x)[0].num_extra_computations
    del model, x, y, wrapped, optimizer
    gc.collect()
    torch.cuda.empty_cache()
    return row


def python_profile(profiler: cProfile.Profile, order: str, count: int) -> list:
    """The busiest ``count`` host functions by ``order``, as pstats prints them (with header)."""
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(count)
    return text.getvalue().splitlines()[-(count + 8):]


def main():
    out = sys.argv[1]
    rows = []
    for config in sys.argv[2:] or DEFAULT:
        try:
            row = profile_config(config)
        except (torch.OutOfMemoryError, RuntimeError, ValueError) as error:
            row = {"config": config, "error": str(error).splitlines()[0][:300]}
            gc.collect()
            torch.cuda.empty_cache()
        rows.append(row)
        print({k: v for k, v in row.items() if k not in ("python_profile", "top_host_ops")},
              flush=True)
    write(os.path.join(out, "profile.json"), {"results": rows})


if __name__ == "__main__":
    main()
