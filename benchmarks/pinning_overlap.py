"""Whether the host store could pin its memory beside the first step rather than in it (issue 16's
first step: the ResNets' first steps spent 5.4-14.4 s pinning, with the device idle).

Each case is a fresh process (PyTorch's pinned allocator caches what it pinned):
- ``compute``: a stand-in for a step's forward, alone: convolutions, each followed by a copy of
  its output to pinned memory (an offload), the host waiting for the device after each;
- ``pin``: pinning GIB in chunks doubling from 256 MiB to 8 GiB, as the store does, alone;
- ``both``: the pinning on a thread of its own while the main thread runs the compute.
Pinning is either PyTorch's pinned allocator with 16 registering threads (the store's setting)
or memory mapped here with 2 MiB pages advised, touched, then registered (``mmap_huge``).
Overlap is real where ``both`` takes about the longer of the two alone and the compute's
slowest iteration does not stall for a chunk's registering.

    python benchmarks/pinning_overlap.py OUT_DIR [--gib 24]
    (CUDA; writes OUT_DIR/pinning_overlap.json)
"""

import json
import mmap
import os
import subprocess
import sys
import threading
import time

ITERATIONS = 400


def pin(total: int, method: str, kept: list) -> dict:
    import torch
    began, size, done, register_s = time.perf_counter(), 256 << 20, 0, 0.0
    while done < total:
        if method == "mmap_huge":
            area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            area.madvise(mmap.MADV_HUGEPAGE)
            chunk = torch.frombuffer(area, dtype=torch.uint8)
            chunk.fill_(0)
            touched = time.perf_counter()
            error = torch.cuda.cudart().cudaHostRegister(chunk.data_ptr(), size, 0)
            assert int(error) == 0, error
            register_s += time.perf_counter() - touched
            kept.append(area)
        else:
            chunk = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        kept.append(chunk)
        done += size
        size = min(2 * size, 8 << 30)
    return {"pin_s": time.perf_counter() - began, "pinned_bytes": done,
            "register_s": register_s if method == "mmap_huge" else None}


def compute() -> dict:
    import torch
    conv = torch.nn.Conv2d(256, 256, 3, padding=1).cuda()
    x = torch.randn(64, 256, 56, 56, device="cuda")
    host = torch.empty(x.numel() * 4, dtype=torch.uint8, pin_memory=True).view(torch.float32)
    host = host.view(x.shape)
    with torch.no_grad():
        for _ in range(5):
            conv(x)
        torch.cuda.synchronize()
        began, slowest = time.perf_counter(), 0.0
        for _ in range(ITERATIONS):
            step = time.perf_counter()
            y = conv(x)
            host.copy_(y, non_blocking=True)
            torch.cuda.synchronize()
            slowest = max(slowest, time.perf_counter() - step)
    seconds = time.perf_counter() - began
    return {"compute_s": seconds, "iteration_ms": 1e3 * seconds / ITERATIONS,
            "slowest_iteration_ms": 1e3 * slowest}


def child(mode: str, method: str, total: int) -> dict:
    import torch
    if method == "register_16":
        torch.cuda.memory._set_allocator_settings(
            "pinned_use_cuda_host_register:True,pinned_num_register_threads:16")
    torch.cuda.init()
    torch.empty(1, device="cuda")
    kept, row = [], {}
    began = time.perf_counter()
    if mode == "pin":
        row.update(pin(total, method, kept))
    elif mode == "compute":
        row.update(compute())
    else:
        pinned = {}
        thread = threading.Thread(target=lambda: pinned.update(pin(total, method, kept)))
        thread.start()
        row.update(compute())
        thread.join()
        row.update(pinned)
    row["wall_s"] = time.perf_counter() - began
    return row


def main():
    if sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3], int(sys.argv[4]))), flush=True)
        return
    out = sys.argv[1]
    gib = float(sys.argv[sys.argv.index("--gib") + 1]) if "--gib" in sys.argv else 24.0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import write
    results = {}
    for method in ("register_16", "mmap_huge"):
        for mode in ("compute", "pin", "both"):
            done = subprocess.run([sys.executable, __file__, "--child", mode, method,
                                   str(int(gib * 2**30))], capture_output=True, text=True)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
            results[f"{method}_{mode}"] = json.loads(lines[-1]) if lines else \
                {"error": done.stderr[-800:]}
            print(method, mode, results[f"{method}_{mode}"], flush=True)
    write(os.path.join(out, "pinning_overlap.json"), {
        "command": " ".join(["python", "benchmarks/pinning_overlap.py"] + sys.argv[1:]),
        "gib": gib, "iterations": ITERATIONS, "results": results})


if __name__ == "__main__":
    main()
