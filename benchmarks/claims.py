"""The README's largest batches and depths as training runs: each claim is 3 full SGD steps
with momentum (optimizer state allocated from the second step) in a fresh process, under the
12 GiB cap with superneurons' 11.5 GiB budget; per step: seconds, peak allocated and reserved,
bytes moved, and whether the peak held the budget (a claim trains when its 3 steps ran within
the cap; cuDNN's workspaces may take what the cap leaves above the budget).

    python benchmarks/claims.py OUT_DIR [--parallel N] [--only NAME ...] [--rounds R] [--steps S]
        [--extra NETWORK:BATCH[:SIZE] ...]

Writes OUT_DIR/claims.json. With --parallel the claims run N processes at a time on the one
GPU, each capped at 12 GiB (their pinned host memory adds up: 4 at a time ran the 125 GiB
host out of memory): whether a claim trains is unchanged, its seconds are not a speed
record (BENCHMARKS.md's speed part is).
"""

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

# (name, network, batch, the ResNet's stage-3 blocks or DenseNet-BC's depth, else None): the
# README's largest batches and depths. VGG16, AlexNet and DenseNet-201 are the largest whose
# plans fit beside momentum and the executor's slack (claim_batches.py,
# results/claim_batches.json); the ResNets and Inception-v4 the largest that trained 3 steps
# (results/claims_zoo.json), below what their plans allow. The ResNet [3, 4, n, 3] at batch 16:
# depth 2,804 trained one step; 2,627 is the deepest whose plan fits beside momentum
# (claim_batches.py --resnet-depth-batch 16, results/claim_depth_resnet_16.json). DenseNet-BC
# (k=12, batch 64): 3,058 trained one step; 2,734 is the deepest whose plan fits beside momentum
# (claim_batches.py --depth-probes, results/claim_depth_densenet_bc_64.json), but the allocator's
# free memory beside the Tensor Cache runs it and every depth down to 2,242 out of memory; 2,206
# is the deepest that trains 3 steps (BENCHMARKS.md, "DenseNet-BC depths that hold").
CLAIMS = [("resnet50_896", "resnet50", 896, None), ("resnet101_896", "resnet101", 896, None),
          ("resnet152_869", "resnet152", 869, None), ("densenet201_783", "densenet201", 783, None),
          ("inception_v4_450", "inception_v4", 450, None), ("vgg16_265", "vgg16", 265, None),
          ("alexnet_2124", "alexnet", 2124, None), ("resnet_depth_2804", "resnet", 16, 924),
          ("resnet_depth_2627", "resnet", 16, 865),
          ("densenet_bc_depth_2734", "densenet_bc", 64, 2734),
          ("densenet_bc_depth_2644", "densenet_bc", 64, 2644),
          ("densenet_bc_depth_2554", "densenet_bc", 64, 2554),
          ("densenet_bc_depth_2206", "densenet_bc", 64, 2206)]
STEPS = 3
CAP_GIB, BUDGET_GIB = 12.0, 11.5


def one(network: str, batch: int, size, steps: int = STEPS) -> dict:
    """One claim in this process: the step's timings and memory, or where it failed."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch
    import superneurons as sn
    from common import (calibration_of, cap_memory, make, make_deep_resnet, make_densenet_bc,
                        sgd, sgd_step)

    cap_memory(CAP_GIB)
    began = time.perf_counter()
    if network == "densenet_bc":
        model, x, y = make_densenet_bc(size, batch)
    elif network == "resnet":
        model, x, y = make_deep_resnet(size, batch)
    else:
        model, x, y = make(network, batch, "cuda")
    row = {"build_s": time.perf_counter() - began}
    wrapped = sn.wrap(model, policy="superneurons", budget=f"{BUDGET_GIB}GiB")
    optimizer = sgd(model)
    row["steps"] = []
    with warnings.catch_warnings(record=True) as said:   # a step past the budget says so
        warnings.simplefilter("always")                  # (untouched.py Rule 4)
        try:
            began = time.perf_counter()
            plan, _ = wrapped.plan_for(x)          # capture and planning, split from the first step
            row["plan_s"] = time.perf_counter() - began
            row["predicted_peak_bytes"] = plan.peak_bytes
            for _ in range(steps):
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                began = time.perf_counter()
                sgd_step(wrapped, optimizer, x, y)
                torch.cuda.synchronize()
                stats = wrapped.stats
                peak = torch.cuda.max_memory_allocated()
                row["steps"].append({
                    "seconds": time.perf_counter() - began, "peak_allocated_bytes": peak,
                    "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
                    "moved_bytes": stats.offloaded_bytes + stats.prefetched_bytes if stats else 0,
                    "drained_convolutions": getattr(stats, "drained_convolutions", 0),
                    # the allocator met a request only after returning its free memory
                    "allocator_retries": getattr(stats, "allocator_retries", None),
                    # the first step's parts: host memory taken (pinned), allocator readings
                    "host_memory_seconds": getattr(stats, "host_memory_seconds", 0.0),
                    "calibration_seconds": getattr(stats, "calibration_seconds", 0.0),
                    # a plan made again beside the optimizer's state shows as planning time and
                    # another predicted peak (module Rule 3)
                    "planning_seconds": getattr(stats, "planning_seconds", 0.0),
                    "predicted_peak_bytes": getattr(stats, "predicted_peak_bytes", None),
                    "budget_held": peak <= BUDGET_GIB * 2**30, **calibration_of(wrapped)})
        except (torch.OutOfMemoryError, RuntimeError, ValueError) as error:
            import traceback
            row["error"] = f"step {len(row['steps']) + 1}: {str(error).splitlines()[0][:300]}"
            row["trace"] = traceback.format_exc().splitlines()[-16:]
            row["calibration_at_failure"] = calibration_of(wrapped)   # the last plan run
    row["warnings"] = [str(w.message) for w in said]
    import resource                        # pinned host memory counts in the process's RSS
    row["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # trains: every step ran within the cap; budget_held: and every peak within the budget
    row["trains"] = "error" not in row and len(row["steps"]) == steps
    row["budget_held"] = row["trains"] and all(s["budget_held"] for s in row["steps"])
    return row


def run_in_child(claim, round_index: int, steps: int) -> dict:
    name, network, batch, size = claim
    command = [sys.executable, __file__, "--child", network, str(batch), str(size), str(steps)]
    began = time.time()
    done = subprocess.run(command, capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.abspath(__file__)))
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    row = json.loads(lines[-1]) if lines else {
        "trains": False, "budget_held": False, "error": f"process ended with {done.returncode}: "
                                 f"{done.stderr.strip().splitlines()[-1:] or ''}"}
    row.update(claim=name, network=network, batch=batch, round=round_index,
               process_s=time.time() - began,
               **({"n3" if network == "resnet" else "depth": size} if size else {}))
    print(json.dumps({k: v for k, v in row.items() if k != "steps"}), flush=True)
    return row


def main():
    if sys.argv[1] == "--child":
        network, batch, size, steps = sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
        print(json.dumps(one(network, batch, None if size == "None" else int(size), steps)),
              flush=True)
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--extra", nargs="*", default=[], metavar="NETWORK:BATCH[:SIZE]",
                        help="more claims to try, e.g. inception_v4:450, densenet_bc:64:2000 "
                             "(DenseNet-BC's depth) or resnet:16:865 (the ResNet's stage-3 "
                             "blocks)")
    args = parser.parse_args()
    for extra in args.extra:
        sized = extra.split(":")[0] in ("resnet", "densenet_bc")
        if extra.count(":") != 1 + sized:
            parser.error(f"--extra takes a zoo network and a batch (inception_v4:450), or "
                         f"resnet or densenet_bc, a batch and a size (densenet_bc:64:2000), "
                         f"not {extra!r}")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import write
    claims = [c for c in CLAIMS if args.only is None or c[0] in args.only] + [
        (extra.replace(":", "_"), extra.split(":")[0], int(extra.split(":")[1]),
         int(extra.split(":")[2]) if extra.count(":") == 2 else None)
        for extra in args.extra]
    jobs = [(claim, r) for r in range(args.rounds) for claim in claims]
    rows = []
    path = os.path.join(args.out, "claims.json")
    with ThreadPoolExecutor(args.parallel) as pool:
        for row in pool.map(lambda job: run_in_child(*job, args.steps), jobs):
            rows.append(row)
            write(path, {"cap_gib": CAP_GIB, "budget_gib": BUDGET_GIB, "steps": args.steps,
                         "parallel": args.parallel, "results": rows}, quiet=True)
    write(path, {"cap_gib": CAP_GIB, "budget_gib": BUDGET_GIB, "steps": args.steps,
                 "parallel": args.parallel, "results": rows})
    print_summary(rows)


def print_summary(rows: list) -> None:
    """What holds: a row per claim and round."""
    from superneurons.cli.output import print_table
    table = []
    for row in rows:
        steps = row.get("steps", [])
        peak = max((s["peak_allocated_bytes"] for s in steps), default=0) / 2**30
        table.append([row["claim"], row["round"], "yes" if row["trains"] else "NO",
                      "yes" if row["budget_held"] else "no",
                      f"{steps[0]['seconds']:.1f}" if steps else "",
                      ", ".join(f"{s['seconds']:.1f}" for s in steps[1:]),
                      f"{peak:.2f}" if steps else "", row.get("error", "")[:28]])
    steps = max((len(row.get("steps", [])) for row in rows), default=STEPS)
    print_table(f"{steps} SGD steps in a {CAP_GIB:g} GiB cap, budget {BUDGET_GIB:g} GiB",
                ["claim", "round", "trains", "budget held", "first s", "later s",
                 "peak GiB", "error"], table)


if __name__ == "__main__":
    main()
