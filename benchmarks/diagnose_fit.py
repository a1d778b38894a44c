"""Why does a superneurons step not fit? One SGD step per (network, batch, budget) under the
cap; on failure, where the step was (forward layer or backward step), what the allocator held,
what the pool held and what the plan said there.

    python3 diagnose_fit.py --network inception_v4 --batches 300 320 --budgets 11.5 10 --out DIR
"""

import argparse
import gc
import os
import traceback

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as run.py

import torch  # noqa: E402 -- after the allocator's configuration

from common import cap_memory, make, sgd, sgd_step, write
import superneurons as sn


def one_step(network: str, batch: int, budget_gib: float) -> dict:
    model, x, y = make(network, batch, "cuda")
    wrapped = sn.wrap(model, budget=f"{budget_gib}GiB")
    optimizer = sgd(model)
    result = {"network": network, "batch": batch, "budget_gib": budget_gib}
    try:
        sgd_step(wrapped, optimizer, x, y)
        torch.cuda.synchronize()
        result.update(ok=True, peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                      stats=wrapped.stats.as_dict())
    except Exception as error:                       # noqa: BLE001 -- the point is to record it
        result.update(ok=False, error=f"{type(error).__name__}: {error}"[:600],
                      cause=repr(error.__cause__)[:600] if error.__cause__ else None,
                      trace=traceback.format_exc().splitlines()[-12:])
        stats = torch.cuda.memory_stats()
        result["allocator"] = {k: stats.get(k, 0) / 2**30 for k in (
            "allocated_bytes.all.current", "allocated_bytes.all.peak",
            "reserved_bytes.all.current", "inactive_split_bytes.all.current")}
        last = wrapped._last
        if last is not None and last[1] is not None:
            plan, executor, _ = last
            step = executor.backward_step
            layer = executor.layer
            where = (f"backward step {step}" if step is not None else
                     f"forward layer {layer.index} {layer.name}" if layer is not None else "?")
            position = step if step is not None else (
                plan.timeline.position[layer.index] if layer is not None else 0)
            position = min(max(position, 0), len(executor.unmanaged) - 1)
            result["executor"] = {
                "where": where, "policy": str(plan.policy),
                "pool_device_gib": executor.pool.device_bytes / 2**30,
                "unmanaged_here_gib": executor.unmanaged[position] / 2**30,
                "unmanaged_max_gib": max(executor.unmanaged) / 2**30,
                "excess_gib": (executor.excess_bytes or 0) / 2**30,
                "foreign_gib": executor.foreign_bytes / 2**30,
                "allowance_here_gib": executor.allowance(position) / 2**30,
                "predicted_peak_gib": plan.peak_bytes / 2**30}
    del wrapped, model, optimizer, x, y
    gc.collect()
    torch.cuda.empty_cache()
    print(result, flush=True)
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--network", default="inception_v4")
    parser.add_argument("--batches", nargs="+", type=int, default=[300, 320])
    parser.add_argument("--budgets", nargs="+", type=float, default=[11.5])
    parser.add_argument("--cap-gib", type=float, default=12.0)
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    cap_memory(args.cap_gib)
    runs = [one_step(args.network, b, g) for b in args.batches for g in args.budgets]
    write(os.path.join(args.out, f"diagnose_{args.network}.json"),
          {"cap_gib": args.cap_gib, "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
           "runs": runs})


if __name__ == "__main__":
    main()
