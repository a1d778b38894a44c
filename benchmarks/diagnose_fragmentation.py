"""Where the allocator's reserved memory goes that no tensor holds: a claim run as claims.py runs
it (12 GiB cap, 11.5 GiB budget, expandable segments, SGD with momentum, a fresh process per
round), with the allocator's state recorded (live blocks and their Python stacks, no trace), and
summarised at the end of every backward and, if one comes, at the out-of-memory itself.

    python benchmarks/diagnose_fragmentation.py OUT_DIR [--network densenet_bc] [--batch 64]
        [--size 2734] [--steps 4] [--rounds 2] [--parallel 2] [--seconds 400]
        [--with-stacks 1] [--arena none|grads|both]
        (CUDA; writes OUT_DIR/diagnose_fragmentation_ROUND.json as each round ends)

A summary, per stream and pool: the bytes mapped, allocated and free, and of the free bytes
those that no page-sized unmapping could return (free blocks share their first and last pages
with live ones: with expandable segments only whole pages are unmapped); for the pages so
stranded, what the live blocks in them were made by.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

from snapshot_peak import where

CAP_GIB, BUDGET_GIB = 12.0, 11.5
MIB = 2**20
# the caching allocator maps expandable segments in pages of 2 MiB (small pool) and 20 MiB
# (large pool): kSmallBuffer and kLargeBuffer in CUDACachingAllocator.cpp
PAGE = {"small": 2 * MIB, "large": 20 * MIB}


def stranded(start: int, size: int, page: int) -> int:
    """Bytes of the free range [start, start + size) outside the whole pages inside it;
    ``start`` from the segment's base, where its pages begin (the base itself is aligned to
    2 MiB only)."""
    first = -(-start // page) * page
    last = (start + size) // page * page
    return size if last <= first else size - (last - first)


def summary(snapshot: dict, top: int = 8) -> dict:
    """Per (stream, pool): mapped, allocated and free bytes, and the free bytes stranded in
    pages shared with live blocks, by both page sizes; where the live neighbours were made."""
    rows = defaultdict(lambda: defaultdict(int))
    pinners = defaultdict(int)
    for segment in snapshot["segments"]:
        pool = segment.get("segment_type", "large")
        row = rows[f"stream {segment['stream']} {pool}"]
        row["segments"] += 1
        row["mapped"] += segment["total_size"]
        row["allocated"] += segment["allocated_size"]
        blocks = segment["blocks"]
        for i, block in enumerate(blocks):
            if block["state"] != "inactive":
                continue
            row["free"] += block["size"]
            row["free_blocks"] += 1
            start = block["address"] - segment["address"]
            lost = stranded(start, block["size"], PAGE[pool])
            row["stranded"] += lost
            row["stranded_at_2MiB"] += stranded(start, block["size"], 2 * MIB)
            if lost:       # half to each live neighbour: an estimate of who pins the pages
                for neighbour in (blocks[i - 1] if i else None,
                                  blocks[i + 1] if i + 1 < len(blocks) else None):
                    if neighbour and neighbour["state"] == "active_allocated":
                        pinners[where(neighbour.get("frames", []))] += lost // 2
    return {"pools": {k: dict(v) for k, v in rows.items()},
            "pinned_by": dict(sorted(pinners.items(), key=lambda kv: -kv[1])[:top])}


def arenas(parameters: list, optimizer, which: str):
    """The experiment of ``--arena``: gradients (and with "both", SGD's momentum) as views of
    one buffer made before the first step, so that no backward scatters them over the pages
    its activations free. Returns the step's zero_grad: it zeroes the buffer and sets every
    .grad to its view again (autograd then adds into it in place). Only for this network,
    whose every parameter gets a gradient each step: a model's unused parameter would get a
    zero gradient where PyTorch leaves None."""
    import torch

    def views(buffer):
        out, offset = [], 0
        for p in parameters:
            out.append(buffer[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return out
    numel = sum(p.numel() for p in parameters)
    flat = torch.zeros(numel, device="cuda")
    grads = views(flat)
    if which == "both":        # momentum 0: the first step's 0.9 * 0 + g is clone(g)'s value
        for p, buffer in zip(parameters, views(torch.zeros(numel, device="cuda"))):
            optimizer.state[p]["momentum_buffer"] = buffer

    def zero_grad():
        flat.zero_()
        for p, grad in zip(parameters, grads):
            p.grad = grad
    return zero_grad


def child(network: str, batch: int, size: int, steps: int, stacks: bool, arena: str) -> None:
    """Prints its row, as a JSON line, after every step and at an out-of-memory."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch
    import torch.nn.functional as F
    import superneurons as sn
    from common import calibration_of, cap_memory, make, make_densenet_bc, sgd

    cap_memory(CAP_GIB)
    build = make_densenet_bc if network == "densenet_bc" else None
    model, x, y = build(size, batch) if build else make(network, batch, "cuda")
    if stacks:                 # who pins the pages; without, the step runs at its own speed
        torch.cuda.memory._record_memory_history(enabled="state", stacks="python")
    row = {"steps": [], "at_oom": None, "stacks": stacks, "arena": arena}

    def at_oom(device, requested, allocated, free):
        row["at_oom"] = {"requested": requested, "stats": stats(),
                         **summary(torch.cuda.memory._snapshot())}

    def stats() -> dict:
        s = torch.cuda.memory_stats()
        return {k: s[f"{k}.all.current"] for k in
                ("allocated_bytes", "reserved_bytes", "inactive_split_bytes")}

    torch._C._cuda_attach_out_of_memory_observer(at_oom)
    wrapped = sn.wrap(model, policy="superneurons", budget=f"{BUDGET_GIB}GiB")
    optimizer = sgd(model)
    zero_grad = lambda: optimizer.zero_grad(set_to_none=True)             # noqa: E731
    if arena != "none":
        zero_grad = arenas([p for p in model.parameters() if p.requires_grad], optimizer, arena)
    try:
        for _ in range(steps):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            began = time.perf_counter()
            zero_grad()
            loss = F.nll_loss(wrapped(x).float(), y)
            loss.backward()
            torch.cuda.synchronize()
            after_backward = {"stats": stats(), **summary(torch.cuda.memory._snapshot())}
            optimizer.step()
            torch.cuda.synchronize()
            print(f"step {len(row['steps']) + 1}: {time.perf_counter() - began:.1f} s",
                  file=sys.stderr, flush=True)
            row["steps"].append({
                "seconds": time.perf_counter() - began,
                "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
                "after_backward": after_backward, **calibration_of(wrapped)})
            print(json.dumps(row), flush=True)
    except torch.OutOfMemoryError as error:
        row["error"] = f"step {len(row['steps']) + 1}: {str(error).splitlines()[0][:300]}"
        print(json.dumps(row), flush=True)


def run_round(args, index: int) -> dict:
    command = [sys.executable, __file__, "--child", args.network, str(args.batch),
               str(args.size), str(args.steps), str(int(index < args.with_stacks)), args.arena]
    try:        # the child prints its row after every step: a round out of time keeps them
        out = subprocess.run(command, stdout=subprocess.PIPE, text=True, timeout=args.seconds,
                             cwd=os.path.dirname(os.path.abspath(__file__))).stdout
    except subprocess.TimeoutExpired as late:
        out = late.stdout.decode() if isinstance(late.stdout, bytes) else late.stdout or ""
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    row = json.loads(lines[-1]) if lines else {"error": "no step ended"}
    row["round"] = index
    from common import write        # each round as it ends: a later one may run out of time
    write(os.path.join(args.out, f"diagnose_fragmentation_{index}.json"),
          {"command": "python benchmarks/diagnose_fragmentation.py " + " ".join(sys.argv[1:]),
           "cap_gib": CAP_GIB, "budget_gib": BUDGET_GIB, **row}, quiet=True)
    print(json.dumps({"round": index, "error": row.get("error"),
                      "peaks": [s["peak_reserved_bytes"] for s in row.get("steps", [])]}),
          flush=True)
    return row


def main():
    if sys.argv[1] == "--child":
        network, batch, size, steps, stacks, arena = sys.argv[2], int(sys.argv[3]), \
            int(sys.argv[4]), int(sys.argv[5]), sys.argv[6] == "1", sys.argv[7]
        child(network, batch, size, steps, stacks, arena)
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--network", default="densenet_bc")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--size", type=int, default=2734)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=400, help="each round's limit")
    parser.add_argument("--with-stacks", type=int, default=1,
                        help="how many rounds record Python stacks (the first ones)")
    parser.add_argument("--arena", choices=("none", "grads", "both"), default="none",
                        help="gradients (both: and momentum) in one buffer of their own")
    args = parser.parse_args()
    with ThreadPoolExecutor(args.parallel) as pool:
        list(pool.map(lambda i: run_round(args, i), range(args.rounds)))


if __name__ == "__main__":
    main()
