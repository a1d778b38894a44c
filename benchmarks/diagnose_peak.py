"""Where a wrapped step's real peak lies between layer boundaries: the allocator's own trace of
one step (torch.cuda.memory._record_memory_history), walked to its highest point by
snapshot_peak.py, with the layer the executor called last before it.

    python benchmarks/diagnose_peak.py OUT.json --network resnet50:88 [--budget 1.5GiB]
        [--cap-gib 2] [--steps 4] [--strict] [--without copies-ahead|free-behind-wait]

As steady.py runs a network (the cap, SGD with momentum, a fresh process); the last step is
traced. Run it under two runtimes (PYTHONPATH) to see what moved a peak.
"""

import argparse
import gc
import os
import sys
import time

def layer_at(times: list, time_us) -> str | None:
    """The layer whose call began last at or before ``time_us`` (``times``: (µs, name))."""
    before = [name for began, name in times if time_us is not None and began <= time_us]
    return before[-1] if before else None


def _without_copies_ahead():
    """Executor Rule 8 undone: no copies are started for the room of layers ahead."""
    from superneurons.runtime.executor import Executor
    Executor._offload_ahead = lambda self, *position: None


def _without_free_behind_wait():
    """Mover Rule 3 undone: room needed now waits on the host for the copies in flight."""
    from superneurons.runtime.mover import Mover
    Mover.reuse_after = lambda self, event: event.synchronize()


WITHOUT = {"copies-ahead": _without_copies_ahead, "free-behind-wait": _without_free_behind_wait}


def described(event: dict) -> dict:
    """An allocation's bytes and its innermost frames (C++ ones too: a cuDNN workspace is
    named only there)."""
    return {"bytes": event["size"],
            "frames": [f"{f['name']} {f['filename'].rsplit('/', 1)[-1]}:{f['line']}"
                       for f in event.get("frames", [])[:14]]}


def largest_live(trace: list, at: int | None, count: int = 8) -> list:
    """The ``count`` largest blocks allocated within the trace and live at event ``at``."""
    if at is None:
        return []
    live = {}
    for event in trace[:at + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_requested":
            live.pop(event["addr"], None)
    return sorted(live.values(), key=lambda e: -e["size"])[:count]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--network", default="resnet50:88")
    parser.add_argument("--budget", default="1.5GiB")
    parser.add_argument("--cap-gib", type=float, default=2.0)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--strict", action="store_true")
    parser.add_argument("--stacks", default="all", choices=("all", "python"),
                        help="python: no C++ frames (a large step's trace then fits in host "
                             "memory; kernels' own blocks show no frames)")
    parser.add_argument("--without", action="append", default=[], choices=sorted(WITHOUT),
                        help="run with one of the runtime's rules undone, to see its effect")
    args = parser.parse_args()
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch
    import superneurons as sn
    from superneurons.runtime import executor as executor_module
    from common import cap_memory, make, sgd, sgd_step, write
    from snapshot_peak import peak, where
    for rule in args.without:
        WITHOUT[rule]()

    name, batch = args.network.split(":")
    cap_memory(args.cap_gib or None)
    torch.manual_seed(0)
    model, x, y = make(name, int(batch), "cuda")
    # a runtime from before strict_budget takes no such argument
    wrapped = sn.wrap(model, budget=args.budget, **({"strict_budget": True} if args.strict else {}))
    optimizer = sgd(model)
    # (µs, layer name) as the executor calls each layer: forward's and replays' (autograd runs
    # the backward's own kernels, so there it names the layer called last)
    times = []
    call = executor_module.Executor._call

    def timed_call(self, layer, *rest, **options):
        times.append((time.time_ns() // 1000, layer.name))
        return call(self, layer, *rest, **options)
    steps = []
    for step in range(1, args.steps + 1):
        last = step == args.steps
        if last:
            executor_module.Executor._call = timed_call
            torch.cuda.memory._record_memory_history(max_entries=500_000, stacks=args.stacks)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        sgd_step(wrapped, optimizer, x, y)
        torch.cuda.synchronize()
        steps.append({"peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                      "offloaded_bytes": wrapped.stats.offloaded_bytes})
    budget_bytes = wrapped.budget_bytes
    # the pool's pinned host memory goes back before the trace is read into Python
    del wrapped, optimizer, model
    gc.collect()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    executor_module.Executor._call = call
    found = peak(snapshot)
    at = found["peak_event"]
    trace = snapshot["device_traces"][0]
    time_us = trace[at].get("time_us") if at is not None else None
    record = {"network": args.network, "budget": args.budget,
              "budget_bytes": budget_bytes, "stacks": args.stacks, "cap_gib": args.cap_gib,
              "strict_budget": args.strict, "without": args.without,
              "runtime": os.path.dirname(sn.__file__),
              "steps": steps, "allocated_when_tracing_began": base,
              "layer_at_peak": layer_at(times, time_us),
              "allocation_at_peak": described(trace[at]) if at is not None else None,
              "largest_live_at_peak": [described(event) for event in largest_live(trace, at)],
              "events_before_peak": [] if at is None else [
                  {"action": e["action"], "bytes": e["size"], "where": where(e.get("frames", []))}
                  for e in trace[max(0, at - 30):at + 1]],
              **found}
    write(args.out, record)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
