"""Where the compute stream stands still in a profiled step, and what runs meanwhile: the gaps
between its kernels, split by the copies running on other streams during each gap.

A step that moves data can keep the device busy (a copy always running) while its compute
waits: the share of the device left idle says nothing of it. A gap during which only copies
to the host run is most likely compute waiting for an offload to free its room (mover Rule 3),
one with copies to the device waiting for a prefetch (Rule 2), one with no copy at all the
host not keeping up.

Read from the Chrome trace torch.profiler exports: kernels, copies and memsets carry their
stream in ``args`` (else in ``tid``); the compute stream is the one whose kernels take the most
time.
"""

from collections import defaultdict

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# gaps shorter than this are kernel launch spacing, not waits
MIN_GAP_US = 20
LARGEST = 8         # the longest gaps listed, with the kernel that ended each


def _overlap(start: float, end: float, events: list) -> float:
    return sum(max(0.0, min(end, e["ts"] + e["dur"]) - max(start, e["ts"])) for e in events)


def _direction(event: dict) -> str:
    name = event["name"]
    if "DtoH" in name:
        return "out"
    if "HtoD" in name:
        return "in"
    return "other"


def stream_gaps(trace: dict, steps: int) -> dict:
    """Per step, in seconds: the compute stream's kernels, its gaps (of at least MIN_GAP_US),
    and the gaps by the copies that ran during them; the LARGEST gaps, in milliseconds."""
    device = [e for e in trace.get("traceEvents", [])
              if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES]
    by_stream = defaultdict(list)
    for event in device:
        by_stream[event.get("args", {}).get("stream", event.get("tid"))].append(event)
    if not by_stream:
        return {}
    compute = max(by_stream, key=lambda s: sum(e["dur"] for e in by_stream[s]
                                               if e["cat"] == "kernel"))
    own = sorted(by_stream[compute], key=lambda e: e["ts"])
    copies = defaultdict(list)
    for stream, events in by_stream.items():
        if stream != compute:
            for event in events:
                if event["cat"] == "gpu_memcpy":
                    copies[_direction(event)].append(event)
    gaps = defaultdict(float)
    largest = []
    for before, after in zip(own, own[1:]):
        start, end = before["ts"] + before["dur"], after["ts"]
        if end - start < MIN_GAP_US:
            continue
        out, back = _overlap(start, end, copies["out"]), _overlap(start, end, copies["in"])
        kind = ("with_copies_both_ways" if out and back else "with_copies_out" if out
                else "with_copies_in" if back else "with_no_copy")
        gaps[kind] += end - start
        gaps["all"] += end - start
        largest.append((end - start, after["name"], out, back))
    largest.sort(key=lambda g: -g[0])
    per_step = 1e-6 / steps
    return {
        "compute_kernels_s": sum(e["dur"] for e in own) * per_step,
        "copies_s": {d: sum(e["dur"] for e in events) * per_step
                     for d, events in copies.items()},
        "gaps_s": {kind: us * per_step for kind, us in gaps.items()},
        "gaps": len(largest) / steps,
        "largest_ms": [{"gap": gap / 1e3, "then": name[:80], "copies_out": out / 1e3,
                        "copies_in": back / 1e3}
                       for gap, name, out, back in largest[:LARGEST]],
    }
