"""Where one slow superneurons step's time goes: planning, then the first step (the one a
bisection probe runs), with the busiest host functions; for networks too deep for
profile_step.py's eight steps (DenseNet-BC of thousands of layers).

    python benchmarks/profile_first_step.py OUT_DIR depth:budget_gib [...]

Each config is DenseNet-BC (k=12, 32 px, batch 64) of that depth under a 12 GiB cap; writes
OUT_DIR/profile_first_step.json.
"""

import cProfile
import gc
import os
import sys
import time

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

import superneurons as sn  # noqa: E402
from superneurons import models  # noqa: E402
from common import cap_memory, sgd, sgd_step, write  # noqa: E402
from profile_step import ALLOCATOR, python_profile  # noqa: E402


def profile_config(config: str, cap_gib: float = 12.0) -> dict:
    depth, budget = config.split(":")
    cap_memory(cap_gib)
    model = models.densenet(int(depth), 12, cifar=True).cuda()
    x = torch.randn(64, 3, 32, 32, device="cuda")
    y = torch.randint(0, 10, (64,), device="cuda")
    wrapped = sn.wrap(model, policy="superneurons", budget=f"{budget}GiB")
    began = time.perf_counter()
    plan, _ = wrapped.plan_for(x)
    row = {"config": config, "layers": len(plan.order), "plan_s": time.perf_counter() - began,
           "predicted_peak_bytes": plan.peak_bytes}
    before = torch.cuda.memory_stats()
    profiler = cProfile.Profile()
    began = time.perf_counter()
    profiler.enable()
    sgd_step(wrapped, sgd(model), x, y)
    torch.cuda.synchronize()
    profiler.disable()
    row["first_step_s"] = time.perf_counter() - began
    row["stats"] = wrapped.stats.as_dict()
    after = torch.cuda.memory_stats()
    row["allocator"] = {k: after.get(k, 0) - before.get(k, 0) for k in ALLOCATOR}
    for order in ("tottime", "cumulative"):
        row[f"python_profile_{order}"] = python_profile(profiler, order, 25)
    del model, x, y, wrapped
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main():
    out, configs = sys.argv[1], sys.argv[2:]
    rows = []
    for config in configs:
        try:
            rows.append(profile_config(config))
        except (torch.OutOfMemoryError, RuntimeError, ValueError) as error:
            rows.append({"config": config, "error": str(error).splitlines()[0][:300]})
            gc.collect()
            torch.cuda.empty_cache()
        print({k: v for k, v in rows[-1].items() if not k.startswith("python_profile")},
              flush=True)
        write(os.path.join(out, "profile_first_step.json"), {"results": rows}, quiet=True)
    write(os.path.join(out, "profile_first_step.json"), {"results": rows})


if __name__ == "__main__":
    main()
