"""Do plans that the planner says fit with nothing moved really fit on the GPU? Each network and
batch is tried at several planner slacks (trim.PLANNED_SHARE: the share of the budget a "nothing
moved" plan may fill), three SGD steps each, under the 12 GiB cap with an 11.5 GiB budget;
a failure records where it happened (forward or backward) and the allocator's state.

    python benchmarks/budget_margin.py OUT_DIR [--no-benchmark]
"""

import gc
import os
import sys
import time
import traceback

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import superneurons as sn  # noqa: E402
from superneurons.planner import trim  # noqa: E402
from common import cap_memory, make, sgd, write  # noqa: E402

CASES = [("resnet101", 160), ("resnet101", 200), ("resnet101", 256), ("resnet152", 300)]
BENCHMARK = "--no-benchmark" not in sys.argv      # the batch part leaves cuDNN's default
SLACKS = [0.97, 0.9, 0.8]


def attempt(network: str, batch: int, slack: float) -> dict:
    trim.PLANNED_SHARE = slack
    model, x, y = make(network, batch, "cuda")
    wrapped = sn.wrap(model, policy="superneurons", budget="11.5GiB")
    optimizer = sgd(model)
    row = {"network": network, "batch": batch, "slack": slack, "steps": []}
    try:
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.reset_peak_memory_stats()
            phase = "forward"
            start = time.perf_counter()
            out = wrapped(x)
            phase = "backward"
            F.nll_loss(out, y).backward()
            phase = "optimizer"
            optimizer.step()
            torch.cuda.synchronize()
            row["steps"].append({"seconds": time.perf_counter() - start,
                                 "peak_bytes": torch.cuda.max_memory_allocated(),
                                 "stats": wrapped.stats.as_dict()})
        row["ok"] = True
    except (torch.OutOfMemoryError, RuntimeError) as error:
        row.update(ok=False, phase=phase, error=str(error).splitlines()[0][:300],
                   where=traceback.format_exc().splitlines()[-12:],
                   allocated=torch.cuda.memory_allocated(),
                   peak=torch.cuda.max_memory_allocated())
    plan, executor = wrapped.plan_for(x)
    row["plan"] = {"peak_bytes": plan.peak_bytes, "segments": len(plan.segments),
                   "whole_blocks": sum(1 for s in plan.segments if any(
                       plan.graph.layers[l].kind.value in ("CONV", "FC") for l in s.layers)),
                   "extra_computations": plan.num_extra_computations}
    if executor is not None:
        row["excess_bytes"], row["seen_excess"] = executor.excess_bytes, executor.seen_excess
    del model, x, y, wrapped, optimizer
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main():
    cap_memory(12)
    torch.backends.cudnn.benchmark = BENCHMARK
    rows = []
    for network, batch in CASES:
        for slack in SLACKS:
            row = attempt(network, batch, slack)
            rows.append(row)
            print({k: v for k, v in row.items() if k not in ("where", "steps")}, flush=True)
            if row["ok"]:
                break
    name = "budget_margin.json" if BENCHMARK else "budget_margin_no_benchmark.json"
    write(os.path.join(sys.argv[1], name), {"cudnn_benchmark": BENCHMARK, "results": rows})


if __name__ == "__main__":
    main()
