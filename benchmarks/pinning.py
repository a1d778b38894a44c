"""How fast the host pins memory, as the Tensor Pool's host store takes it (runtime/host.py: chunks
doubling from 256 MiB to 8 GiB), under PyTorch's pinned-allocator settings; each setting in a
fresh process (the settings are the process's).

    python benchmarks/pinning.py OUT_DIR [--gib 24]

Settings: PyTorch's default (cudaHostAlloc); pinned_use_cuda_host_register with 8 and 16
threads mapping the pages first, given in PYTORCH_CUDA_ALLOC_CONF; and the same set at run time
through torch.cuda.memory._set_allocator_settings (how a library would set it). Also the
copy bandwidth from such memory, to see that it is as pinned. Writes OUT_DIR/pinning.json.
"""

import json
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
}


def child(total_gib: float, runtime_settings: str | None) -> dict:
    import torch
    if runtime_settings:
        torch.cuda.memory._set_allocator_settings(runtime_settings)
    torch.cuda.init()
    chunks, size, total = [], 256 << 20, 0
    began = time.perf_counter()
    while total < total_gib * 2**30:
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
            "copy_gb_per_s": chunks[-1].numel() / 1e9 / copy_seconds}


def main():
    if sys.argv[1] == "--child":
        print(json.dumps(child(float(sys.argv[2]), sys.argv[3] or None)), flush=True)
        return
    out = sys.argv[1]
    total_gib = float(sys.argv[sys.argv.index("--gib") + 1]) if "--gib" in sys.argv else 24.0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import write
    results = {}
    for name, (env_settings, runtime_settings) in SETTINGS.items():
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": env_settings}
        done = subprocess.run([sys.executable, __file__, "--child", str(total_gib),
                               runtime_settings or ""], env=env, capture_output=True, text=True)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        results[name] = json.loads(lines[-1]) if lines else {"error": done.stderr[-500:]}
        print(name, results[name], flush=True)
    write(os.path.join(out, "pinning.json"), {"total_gib": total_gib, "results": results})


if __name__ == "__main__":
    main()
