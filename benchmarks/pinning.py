"""How fast the host pins memory, as the Tensor Pool's host store takes it (runtime/host.py: chunks
doubling from 256 MiB to 8 GiB), under PyTorch's pinned-allocator settings; each setting in a
fresh process (the settings are the process's).

    python benchmarks/pinning.py OUT_DIR [--gib 24] [--only SETTING ...]

Settings: PyTorch's default (cudaHostAlloc); pinned_use_cuda_host_register with 8 and 16
threads mapping the pages first, given in PYTORCH_CUDA_ALLOC_CONF; and the same set at run time
through torch.cuda.memory._set_allocator_settings (how a library would set it). Then memory
mapped here, touched by torch's threads and registered with cudaHostRegister, with and without
madvise(MADV_HUGEPAGE): whether 2 MiB pages pin faster (touching and registering timed apart).
Also the copy bandwidth from such memory, to see that it is as pinned, and the kernel's
transparent huge page settings. Writes OUT_DIR/pinning.json.
"""

import json
import mmap
import os
import subprocess
import sys
import time

SETTINGS = {
    "default": ("", None),
    "register_8_threads_env": (
        "pinned_use_cuda_host_register:True,pinned_num_register_threads:8", None),
    "register_16_threads_env": (
        "pinned_use_cuda_host_register:True,pinned_num_register_threads:16", None),
    "register_8_threads_runtime": (
        "", "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"),
    "mmap_register": ("", "mmap"),
    "mmap_hugepage_register": ("", "mmap_huge"),
}


def mapped_chunk(size: int, huge: bool, timings: dict):
    """``size`` bytes mapped here, touched on torch's threads, then registered with CUDA."""
    import torch
    began = time.perf_counter()
    area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        area.madvise(mmap.MADV_HUGEPAGE)
    tensor = torch.frombuffer(area, dtype=torch.uint8)
    tensor.fill_(0)                                       # page faults, on torch's threads
    touched = time.perf_counter()
    error = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), size, 0)
    assert int(error) == 0, error
    timings["touch_s"] = timings.get("touch_s", 0.0) + touched - began
    timings["register_s"] = timings.get("register_s", 0.0) + time.perf_counter() - touched
    return tensor, area


def child(total_gib: float, runtime_settings: str | None) -> dict:
    import torch
    mapped = runtime_settings in ("mmap", "mmap_huge")
    if runtime_settings and not mapped:
        torch.cuda.memory._set_allocator_settings(runtime_settings)
    torch.cuda.init()
    chunks, size, total, timings, areas = [], 256 << 20, 0, {}, []
    began = time.perf_counter()
    while total < total_gib * 2**30:
        if mapped:
            chunk, area = mapped_chunk(size, runtime_settings == "mmap_huge", timings)
            chunks.append(chunk)
            areas.append(area)
        else:
            chunks.append(torch.empty(size, dtype=torch.uint8, pin_memory=True))
        total += size
        size = min(2 * size, 8 << 30)
    seconds = time.perf_counter() - began
    device = torch.empty(chunks[-1].numel(), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    copy_began = time.perf_counter()
    device.copy_(chunks[-1], non_blocking=True)
    torch.cuda.synchronize()
    copy_seconds = time.perf_counter() - copy_began
    return {"pinned_bytes": total, "seconds": seconds, "gib_per_s": total / 2**30 / seconds,
            "is_pinned": chunks[-1].is_pinned(),
            "copy_gb_per_s": chunks[-1].numel() / 1e9 / copy_seconds,
            "anon_huge_pages_kib": _meminfo("AnonHugePages"), **timings}


def _meminfo(field: str):
    with open("/proc/meminfo") as info:
        for line in info:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


def _thp_settings() -> dict:
    settings = {}
    for name in ("enabled", "defrag"):
        try:
            with open(f"/sys/kernel/mm/transparent_hugepage/{name}") as f:
                settings[name] = f.read().strip()
        except OSError as error:
            settings[name] = str(error)
    return settings


def main():
    if sys.argv[1] == "--child":
        print(json.dumps(child(float(sys.argv[2]), sys.argv[3] or None)), flush=True)
        return
    out = sys.argv[1]
    total_gib = float(sys.argv[sys.argv.index("--gib") + 1]) if "--gib" in sys.argv else 24.0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import write
    results = {}
    only = sys.argv[sys.argv.index("--only") + 1:] if "--only" in sys.argv else list(SETTINGS)
    for name, (env_settings, runtime_settings) in SETTINGS.items():
        if name not in only:
            continue
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": env_settings}
        done = subprocess.run([sys.executable, __file__, "--child", str(total_gib),
                               runtime_settings or ""], env=env, capture_output=True, text=True)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        results[name] = json.loads(lines[-1]) if lines else {"error": done.stderr[-500:]}
        print(name, results[name], flush=True)
    write(os.path.join(out, "pinning.json"),
          {"total_gib": total_gib, "transparent_hugepage": _thp_settings(), "results": results})


if __name__ == "__main__":
    main()
