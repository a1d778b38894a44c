"""Where a step that trusts its calibration peaks above the steps that calibrated (ResNet-101 at
batch 896 under the 12 GiB cap passed its 11.5 GiB budget by 120 MiB in every such step:
claims_resnet101_896_8_steps.json).

Records the caching allocator's trace (no stacks: recording Python stacks slowed the host, and
the step then held) over a calibrating and a trusting step. Layer and autograd-node boundaries
are marked by small allocations on a stream of their own, which the trace keeps in order, so
each step's allocated bytes can be read per boundary and the two steps compared where they part.

    python benchmarks/diagnose_trusting_peak.py OUT_DIR [--network resnet101] [--batch 896]
        [--steps 3] [--sync forward|backward|both] [--no-record] [--bare]
        (CUDA; writes OUT_DIR/diagnose_trusting_peak.json)
"""

import argparse
import os
import sys
import time

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch
import torch.nn.functional as F

from common import calibration_of, cap_memory, make, sgd, write

CAP_GIB, BUDGET_GIB = 12.0, 11.5


class Marks:
    """Boundaries as allocations on a stream no other work uses."""

    def __init__(self, sync: str | None = None):
        self.stream = torch.cuda.Stream()
        self.names: list = []
        self.sync = sync          # where the host waits for the device at every mark
        self.phase = "forward"    # replays in backward are marked as layers, in backward

    def __call__(self, name: str) -> None:
        self.names.append(name)
        if self.sync in ("both", self.phase):
            torch.cuda.synchronize()
        with torch.cuda.stream(self.stream):
            torch.empty(512, dtype=torch.uint8, device="cuda")

    def on_backward(self, root) -> None:
        """A mark before every autograd node reachable from ``root`` runs."""
        self.phase = "backward"
        seen, todo = set(), [root]
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            node.register_prehook(lambda grads, name=node.name(): self(f"backward {name}"))
            todo.extend(next_node for next_node, _ in node.next_functions)


def curve(snapshot: dict, marks: Marks, start: int) -> dict:
    """Allocated bytes at each mark and the step's peak, with what was allocated since the mark
    before the peak; ``start``: what was allocated when the trace began."""
    events = snapshot["device_traces"][0]
    allocated, peak, peak_at, mark_index = start, -1, None, -1
    at_marks, live, since = [], {}, []
    for event in events:
        action, size = event["action"], event["size"]
        if event["stream"] == marks.stream.cuda_stream:
            if action == "alloc":
                mark_index += 1
                at_marks.append(allocated)
                since = []
            continue
        if action == "alloc":
            allocated += size
            live[event["addr"]] = size
            since.append(size)
            if allocated > peak:
                peak, peak_at, peak_since = allocated, mark_index, list(since)
        elif action == "free_requested":      # where the allocator's allocated bytes drop,
            allocated -= live.pop(event["addr"], size)      # its stream uses still pending
    return {"allocated_at_marks": at_marks, "peak_bytes": peak, "peak_after_mark": peak_at,
            "peak_after": marks.names[peak_at] if 0 <= peak_at < len(marks.names) else None,
            "allocated_since_that_mark": sorted(peak_since, reverse=True)[:12],
            "events": len(events)}


def step(wrapped, optimizer, x, y, marks: Marks | None, record: bool) -> dict:
    """One step; ``marks`` None runs it bare, as claims.py does (marks slow the host)."""
    from superneurons.runtime import executor as executor_module
    run_layer = executor_module.Executor._run_layer

    def marked(self, layer, *args, **kwargs):
        marks(f"layer {layer.name}")
        return run_layer(self, layer, *args, **kwargs)
    if marks is not None:
        marks.names, marks.phase = [], "forward"
        executor_module.Executor._run_layer = marked
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    began, start = time.perf_counter(), torch.cuda.memory_allocated()
    if record:
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python")
    try:
        optimizer.zero_grad(set_to_none=True)
        loss = F.nll_loss(wrapped(x).float(), y)
        if marks is not None:
            marks.on_backward(loss.grad_fn)
        loss.backward()
        optimizer.step()
        torch.cuda.synchronize()
        row = {"seconds": time.perf_counter() - began,
               "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
               "offloaded_bytes": wrapped.stats.offloaded_bytes,
               "drained_convolutions": wrapped.stats.drained_convolutions,
               **calibration_of(wrapped)}
        if record and marks is not None:
            row.update(curve(torch.cuda.memory._snapshot(), marks, start))
            row["mark_names"] = list(marks.names)
    finally:
        executor_module.Executor._run_layer = run_layer
        if record:
            torch.cuda.memory._record_memory_history(enabled=None)
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--network", default="resnet101")
    parser.add_argument("--batch", type=int, default=896)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sync", choices=("forward", "backward", "both"), default=None,
                        help="the host waits for the device at every layer (forward), autograd "
                             "node (backward) or both: does a host running ahead of the device "
                             "make the peak?")
    parser.add_argument("--no-record", action="store_true", help="peaks only, no trace")
    parser.add_argument("--bare", action="store_true",
                        help="no marks at layers and autograd nodes (they slow the host, and "
                             "ResNet-101 held its budget with them where claims.py's steps "
                             "did not); implies --no-record")
    args = parser.parse_args()
    import superneurons as sn

    cap_memory(CAP_GIB)
    model, x, y = make(args.network, args.batch, "cuda")
    wrapped = sn.wrap(model, policy="superneurons", budget=f"{BUDGET_GIB}GiB")
    optimizer, marks = sgd(model), None if args.bare else Marks(sync=args.sync)
    rows = [step(wrapped, optimizer, x, y, marks,
                 record=index >= 1 and not (args.no_record or args.bare))
            for index in range(args.steps)]
    # where the last step parts from the calibrating step before it: the first mark at which
    # it holds more than that step did, by more than 64 MiB
    calibrating, trusting = rows[1], rows[-1]
    parted = None
    if "mark_names" in trusting and calibrating.get("mark_names") == trusting["mark_names"]:
        for index, (a, b) in enumerate(zip(calibrating["allocated_at_marks"],
                                           trusting["allocated_at_marks"])):
            if b - a > 64 << 20:
                parted = {"mark": index, "name": trusting["mark_names"][index],
                          "calibrating_bytes": a, "trusting_bytes": b}
                break
    for row in rows[1:] if "mark_names" in trusting else ():   # long curves: every 8th
        row["allocated_at_marks"] = row["allocated_at_marks"][::8]
        row.pop("mark_names", None)
    name = "diagnose_trusting_peak" + ("_bare" if args.bare else "") + \
        (f"_sync_{args.sync}" if args.sync else "") + ".json"
    write(os.path.join(args.out, name), {
        "command": " ".join(["python", "benchmarks/diagnose_trusting_peak.py"] + sys.argv[1:]),
        "network": args.network, "batch": args.batch, "cap_gib": CAP_GIB,
        "budget_gib": BUDGET_GIB, "sync": args.sync, "steps": rows,
        "parted": parted})


if __name__ == "__main__":
    main()
