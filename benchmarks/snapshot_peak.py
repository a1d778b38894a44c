"""What the device held at a step's peak, from an allocator snapshot (torch.cuda.memory's
_dump_snapshot of a recorded step): the blocks live at the peak, grouped by where they were made.

    python benchmarks/snapshot_peak.py SNAPSHOT.pickle [OUT.json]

The trace starts where recording began: blocks made before are not in it (the peak is counted
above what was allocated then).
"""

import json
import pickle
import sys
from collections import defaultdict


LIBRARIES = ("transformers", "torchvision", "torch/nn", "torch/autograd")


def where(frames: list, libraries=LIBRARIES) -> str:
    """The innermost frames of this project and of the model's library (a path containing one
    of ``libraries``), else the innermost."""
    ours = [f for f in frames if "superneurons" in f["filename"]]
    model = [f for f in frames if any(name in f["filename"] for name in libraries)]
    picked = (ours[:2] + model[:1]) or frames[:2]
    return " | ".join(f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']} {f['name']}"
                      for f in picked)


def live_blocks(libraries: tuple, top: int) -> dict:
    """The device's allocated blocks now, grouped by where they were made (``where``), the
    ``top`` largest groups: a snapshot taken while the allocator records its history."""
    import torch
    groups = defaultdict(int)
    for segment in torch.cuda.memory._snapshot()["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                groups[where(block.get("frames", []), libraries)] += block["size"]
    return dict(sorted(groups.items(), key=lambda kv: -kv[1])[:top])


def peak(snapshot: dict, device: int = 0) -> dict:
    live, current, best, at, held = {}, 0, 0, None, {}
    events = snapshot["device_traces"][device]
    for index, event in enumerate(events):
        if event["action"] == "alloc":
            live[event["addr"]] = event
            current += event["size"]
        elif event["action"] in ("free_requested",) and event["addr"] in live:
            current -= live.pop(event["addr"])["size"]
        if current > best:
            best, at, held = current, index, dict(live)
    groups = defaultdict(lambda: [0, 0])
    for event in held.values():
        group = groups[where(event.get("frames", []))]
        group[0] += event["size"]
        group[1] += 1
    top = sorted(groups.items(), key=lambda kv: -kv[1][0])[:40]
    return {"events": len(events), "peak_above_start_bytes": best, "peak_event": at,
            "live_at_peak": [{"where": k, "bytes": v[0], "blocks": v[1]} for k, v in top]}


if __name__ == "__main__":
    with open(sys.argv[1], "rb") as handle:
        result = peak(pickle.load(handle))
    text = json.dumps(result, indent=1)
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as handle:
            handle.write(text)
    print(text[:6000])
