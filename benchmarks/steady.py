"""Whether the budget holds from the first step to the thousandth (issue 16): many SGD steps with
momentum per network, each network in a fresh process under the cap; per step its seconds, the
device's peaks (allocated, reserved), what stays allocated after it, the host's resident memory
and what the runtime moved and replayed; a summary says whether memory grew, whether any step
went over the budget and where one ran out of memory.

    python benchmarks/steady.py OUT_DIR --network resnet50:896 --network densenet121:800 \
        [--steps 1000] [--seconds S] [--budget 11.5GiB] [--cap-gib 12] [--device cuda] \
        [--strict-budget] \
        [--image-size PX]

Writes OUT_DIR/steady_<network>_<batch>.json per network, rewritten as the run goes, so a
process stopped midway leaves the steps it ran. Step 1's seconds include capture and planning
(the wrapped model plans in its first call, as a user's does). --seconds bounds each network's
run (build, planning, steps): no step starts that the last step's time says would end past it.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from claims import BUDGET_GIB, CAP_GIB

SEED = 0
SAVE_EVERY_S = 30.0             # a killed run loses at most this much
GRACE_S = 120.0                 # past --seconds the parent stops a child stuck in one step
# growth beyond these, step 10 to the last, is flagged: the device's allocations repeat
# exactly from step to step, the host's resident memory moves with Python's and glibc's own
ALLOCATED_TOLERANCE = 2**20
RSS_TOLERANCE = 64 * 2**20
# per step; the last five are the wrapped model's stats (a new predicted peak: a new plan;
# policy "liveness": the step ran untouched)
FIELDS = ("seconds", "peak_allocated_bytes", "peak_reserved_bytes", "allocated_bytes",
          "rss_bytes", "offloaded_bytes", "prefetched_bytes", "recomputed_layers",
          "predicted_peak_bytes", "policy")


def summarize(steps: dict, budget_bytes: int | None, out_of_memory=None,
              from_step: int = 10) -> dict:
    """The run in a few numbers, from the per-step lists of FIELDS (None where not measured:
    device numbers on the CPU)."""
    seconds = steps["seconds"]
    n = len(seconds)
    peaks = steps["peak_allocated_bytes"]
    measured = [(i + 1, p) for i, p in enumerate(peaks) if p is not None]
    over = [step for step, p in measured if budget_bytes is not None and p > budget_bytes]
    # step 1 allocates momentum and pins host memory: growth is counted from a later step
    reference = min(from_step, n)

    def growth(field):
        values = steps[field]
        if n <= reference or values[-1] is None or values[reference - 1] is None:
            return None
        return values[-1] - values[reference - 1]
    summary = {
        "steps_run": n,
        "first_step_seconds": seconds[0] if n else None,
        "median_steady_seconds": statistics.median(seconds[1:]) if n > 1 else None,
        "max_peak_allocated_after_first_bytes": max((p for s, p in measured if s > 1),
                                                    default=None),
        "budget_bytes": budget_bytes,
        "budget_held": None if not measured or budget_bytes is None else not over,
        "steps_over_budget": len(over),
        "first_step_over_budget": over[0] if over else None,
        "growth_from_step": reference if n > reference else None,
        "allocated_growth_bytes": growth("allocated_bytes"),
        "reserved_growth_bytes": growth("peak_reserved_bytes"),
        "rss_growth_bytes": growth("rss_bytes"),
        "out_of_memory": out_of_memory,
        "untouched_steps": sum(policy == "liveness" for policy in steps.get("policy", [])),
    }
    summary["grows"] = any(g is not None and g > tolerance for g, tolerance in (
        (summary["allocated_growth_bytes"], ALLOCATED_TOLERANCE),
        (summary["rss_growth_bytes"], RSS_TOLERANCE)))
    return summary


def measure(args, network: str, batch: int, path: str) -> None:
    """One network's run in this process; its record at ``path``, written as it goes."""
    began = time.perf_counter()
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as claims
    import torch
    import superneurons as sn
    from common import cap_memory, make, rss_bytes, sgd, sgd_step, write

    cuda = args.device == "cuda"
    if cuda:
        cap_memory(args.cap_gib or None)
    torch.manual_seed(SEED)
    built = time.perf_counter()
    model, x, y = make(network, batch, args.device, image=args.image_size)
    wrapped = sn.wrap(model, budget=args.budget,
                      **({"strict_budget": True} if args.strict_budget else {}))
    optimizer = sgd(model)     # momentum buffers appear in step 1 and stay
    steps = {field: [] for field in FIELDS}
    record = {"network": network, "batch": batch, "steps_asked": args.steps,
              **({} if cuda else {"device": "cpu"}),     # not the host's GPU, if it has one
              "budget": args.budget, "cap_gib": args.cap_gib if cuda else None,
              "strict_budget": args.strict_budget,
              "seconds_limit": args.seconds, "image_size": args.image_size, "seed": SEED,
              "build_seconds": time.perf_counter() - built, "stopped": "running", "steps": steps}
    out_of_memory = None

    def save():
        record["summary"] = summarize(steps, wrapped.budget_bytes, out_of_memory)
        write(path, record, quiet=True)
    saved = time.perf_counter()
    try:
        for step in range(1, args.steps + 1):
            elapsed = time.perf_counter() - began
            if args.seconds and step > 1 and elapsed + steps["seconds"][-1] > args.seconds:
                record["stopped"] = "seconds"
                break
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            sgd_step(wrapped, optimizer, x, y)
            if cuda:
                torch.cuda.synchronize()
            seconds, stats = time.perf_counter() - start, wrapped.stats
            for field, value in zip(FIELDS, (
                    round(seconds, 5),
                    torch.cuda.max_memory_allocated() if cuda else None,
                    torch.cuda.max_memory_reserved() if cuda else None,
                    torch.cuda.memory_allocated() if cuda else None, rss_bytes(),
                    stats.offloaded_bytes, stats.prefetched_bytes, stats.recomputed_layers,
                    stats.predicted_peak_bytes, stats.policy)):
                steps[field].append(value)
            if step == 1:         # issue 16 item 4: where the first step's time went
                record["first_step_split_seconds"] = {
                    name: value for name, value in stats.as_dict().items()
                    if name.endswith("_seconds")}
            if step == 1 or step % 50 == 0:
                print(progress(network, batch, step, steps), flush=True)
            if time.perf_counter() - saved > SAVE_EVERY_S:
                save()
                saved = time.perf_counter()
        else:
            record["stopped"] = "steps"
    except Exception as error:       # the record says why the run ended, at which step
        message = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        failed = {"step": len(steps["seconds"]) + 1, "message": message}
        # PyTorch's own, or the runtime's RuntimeError around it ("out of device memory")
        if isinstance(error, torch.OutOfMemoryError) or ("out of" in message and
                                                         "memory" in message):
            out_of_memory, record["stopped"] = failed, "out_of_memory"
        else:
            record["error"], record["stopped"] = failed, "error"
        error.__traceback__ = None   # the frames hold the failed step's tensors
    save()
    print(progress(network, batch, len(steps["seconds"]), steps), record["stopped"], flush=True)


def progress(network, batch, step, steps) -> str:
    def last_gib(field):
        value = steps[field][-1] if step else None
        return "-" if value is None else f"{value / 2**30:.2f}"
    return (f"  {network}:{batch} step {step}: {steps['seconds'][-1] if step else 0:.3f} s, "
            f"peak {last_gib('peak_allocated_bytes')} GiB, host {last_gib('rss_bytes')} GiB")


def run_in_child(args, network: str, batch: int) -> dict:
    """One network in a fresh process (as claims.py: nothing one run leaves in the allocator,
    pinned host memory or cuDNN's caches reaches the next); its record, or why there is none."""
    path = os.path.join(args.out, f"steady_{network}_{batch}.json")
    if os.path.exists(path):
        os.remove(path)              # a record left by an earlier run is not this one's
    command = [sys.executable, os.path.abspath(__file__), args.out, "--child",
               "--network", f"{network}:{batch}", "--steps", str(args.steps),
               "--budget", args.budget, "--cap-gib", str(args.cap_gib),
               *(["--strict-budget"] * args.strict_budget),
               "--device", args.device, *(["--seconds", str(args.seconds)] * bool(args.seconds)),
               *(["--image-size", str(args.image_size)] * bool(args.image_size))]
    try:
        done = subprocess.run(command, stderr=subprocess.PIPE, text=True,
                              timeout=args.seconds + GRACE_S if args.seconds else None)
        ended, stderr = done.returncode, done.stderr
        if ended < 0:                # the host's out-of-memory killer sends signal 9
            ended = f"killed by signal {-ended}"
    except subprocess.TimeoutExpired as expired:
        ended, stderr = "stopped past the time limit", expired.stderr or ""
        stderr = stderr.decode() if isinstance(stderr, bytes) else stderr
    sys.stderr.write(stderr)
    record = {"network": network, "batch": batch, "summary": {"steps_run": 0}}
    if os.path.exists(path):
        with open(path) as saved:
            record = json.load(saved)
    if record.get("stopped", "running") == "running":   # the child did not finish its record
        lines = stderr.strip().splitlines()
        record["stopped"] = "process ended"
        record["error"] = {"step": record["summary"].get("steps_run", 0) + 1,
                           "message": f"process: {ended}. {lines[-1] if lines else ''}".strip()}
        from common import write
        write(path, record, quiet=True)
    return record


def print_summary(records: list) -> None:
    """A row per network; plain columns (rich would cut the names to 80 columns off a terminal)."""
    def scaled(value, unit=2**30, digits=2):
        return "" if value is None else f"{value / unit:.{digits}f}"
    rows, failures = [["net:batch", "steps", "stopped", "1st s", "median s", "peak GiB",
                       "over budget", "+device MiB", "+host MiB"]], []
    for r in records:
        s = r["summary"]
        rows.append([f"{r['network']}:{r['batch']}", s["steps_run"], r["stopped"],
                     scaled(s.get("first_step_seconds"), 1, 1),
                     scaled(s.get("median_steady_seconds"), 1, 3),
                     scaled(s.get("max_peak_allocated_after_first_bytes")),
                     s.get("steps_over_budget", ""),
                     scaled(s.get("allocated_growth_bytes"), 2**20, 1),
                     scaled(s.get("rss_growth_bytes"), 2**20, 1)])
        failed = s.get("out_of_memory") or r.get("error")
        if failed:
            failures.append(f"{rows[-1][0]} step {failed['step']}: {failed['message']}")
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    print("peak: the largest of steps 2 to the last; growth: step 10 to the last")
    for row in rows:
        print("  ".join([str(row[0]).ljust(widths[0])] +
                        [str(v).rjust(w) for v, w in zip(row[1:], widths[1:])]))
    for line in failures:
        print(line)


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--network", action="append", required=True, metavar="NAME:BATCH")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--budget", default=f"{BUDGET_GIB}GiB")
    parser.add_argument("--cap-gib", type=float, default=CAP_GIB, help="0: no cap")
    parser.add_argument("--seconds", type=float, default=None, help="per network")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--image-size", type=int, default=None, help="the zoo's own if unset")
    parser.add_argument("--strict-budget", action="store_true",
                        help="sn.wrap(..., strict_budget=True): the allocator limited to "
                             "the budget")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    networks = [(name, int(batch)) for name, batch in (n.split(":") for n in args.network)]
    from superneurons.models.zoo import ZOO      # a misspelt name fails here, not on the device
    unknown = [name for name, _ in networks if name not in ZOO]
    if unknown:
        parser.error(f"unknown network {', '.join(unknown)}; the zoo has {', '.join(ZOO)}")
    if args.child:
        (network, batch), = networks
        measure(args, network, batch, os.path.join(args.out, f"steady_{network}_{batch}.json"))
        return []
    records = [run_in_child(args, network, batch) for network, batch in networks]
    print_summary(records)
    return records


if __name__ == "__main__":
    main()
