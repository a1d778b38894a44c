"""The rates the planner weighs replays against moves with (planner/costs.Machine), measured
once per device and math settings on the device a plan runs on.

Each rate is the fastest of a few timed repetitions after one untimed run (the first call of
a kernel pays for its handle and its choice of algorithm). The operands are filled with a
constant, not drawn: drawing would advance the device's random generator and change the
model's dropout masks. Autocast is off while measuring, so each dtype runs as asked, and the
current TF32 settings hold: they are part of the cache key, since they set fp32's rates.

Measuring costs a first step tenths of a second on the GPU (each dtype's first convolution
chooses its algorithm), so the rates are kept on disk too: a later process on the same device
and library versions reads them (SUPERNEURONS_CACHE_DIR, by default
~/.cache/superneurons; set it empty to measure in every process). A cache that cannot be read
or written is measured around, never an error. Rates measured while other processes hold more
than a bare context's memory on the device are this process's alone: their kernels may have
shared the device with the measurement (bf16 convolutions measured at 1.22e13 FLOP/s beside
other training processes' first steps, 3.5e14 alone), and a later process would plan with them.
The process that measured them still plans with them.
"""

import json
import logging
import os
import time
from dataclasses import asdict

import torch
import torch.nn.functional as F

from ..planner.costs import OFF_CUDA, Machine

__all__ = ["machine_of"]

log = logging.getLogger("superneurons")
CACHE_DIR = "SUPERNEURONS_CACHE_DIR"     # environment: where measured rates are kept

_MEASURED: dict = {}
_COPY_BYTES = 32 << 20       # long enough that launch latency is a few percent of a copy
_MATMUL_SIZE = 2048
_CONV = (32, 256, 28, 28)    # a ResNet stage-2 3x3 convolution: batch, channels, height, width
_REPEATS = 5
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# device memory this process and idle others may hold outside its allocator and still measure
# alone: its own CUDA context and another process's bare one (738 MiB in the out-of-memory
# message of benchmarks/results/ratio_resnet50_fp32_998e2f5_contended_rates.json)
_CONTEXTS_BYTES = 2 << 30


def machine_of(device: torch.device) -> Machine:
    """The device's measured rates; H200's defaults off CUDA (a plan made for a CPU run
    weighs nothing it can move), with the pool counting bytes as they are."""
    if device.type != "cuda":
        return OFF_CUDA
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    if key not in _MEASURED:
        disk_key = _disk_key(index, key[1:])
        machine = _load(disk_key)
        if machine is None:
            log.info("measuring %s's rates (memory, link, convolutions, matrix products)",
                     torch.cuda.get_device_name(index))
            with torch.cuda.device(index), torch.no_grad(), \
                    torch.autocast("cuda", enabled=False):
                machine = _measure(torch.device("cuda", index))
            if _alone(index):
                _store(disk_key, machine)
            else:
                log.info("other processes hold memory on %s: its measured rates are kept for "
                         "this process alone", torch.cuda.get_device_name(index))
        _MEASURED[key] = machine
    return _MEASURED[key]


def _alone(index: int) -> bool:
    """Whether no other process holds more of the device than a bare context."""
    free, total = torch.cuda.mem_get_info(index)
    return total - free - torch.cuda.memory_reserved(index) <= _CONTEXTS_BYTES


def _disk_key(index: int, tf32: tuple) -> str:
    """What the rates depend on beyond the process: the device and the libraries."""
    properties = torch.cuda.get_device_properties(index)
    return "|".join(map(str, (
        properties.name, getattr(properties, "uuid", index), properties.total_memory,
        torch.__version__, torch.version.cuda, torch.backends.cudnn.version(), *tf32)))


def _cache_path() -> str | None:
    folder = os.environ.get(CACHE_DIR)
    if folder is None:
        folder = os.path.join(os.path.expanduser("~"), ".cache", "superneurons")
    return os.path.join(folder, "machine_rates.json") if folder else None


def _read_cache(path: str) -> dict:
    try:
        with open(path) as f:
            cached = json.load(f)
        return cached if isinstance(cached, dict) else {}
    except (OSError, ValueError):
        return {}


def _load(key: str) -> Machine | None:
    path = _cache_path()
    entry = _read_cache(path).get(key) if path else None
    try:
        return Machine(**entry) if entry else None
    except TypeError:                   # written by another version of Machine: measure again
        return None


def _store(key: str, machine: Machine) -> None:
    path = _cache_path()
    if not path:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        cached = _read_cache(path)
        cached[key] = asdict(machine)
        partial = f"{path}.{os.getpid()}.tmp"        # processes writing at once each replace
        with open(partial, "w") as f:
            json.dump(cached, f, indent=1)
        os.replace(partial, path)
    except OSError as error:
        log.debug("measured rates not kept on disk (%s)", error)


def fastest_seconds(run) -> float:
    """The fastest of _REPEATS timed runs of ``run`` on the current stream."""
    run()
    best = float("inf")
    for _ in range(_REPEATS):
        torch.cuda.synchronize()
        began = time.perf_counter()
        run()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - began)
    return best


def _measure(device: torch.device) -> Machine:
    source = torch.empty(_COPY_BYTES, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    memory = 2 * _COPY_BYTES / fastest_seconds(lambda: target.copy_(source))   # read and write
    host = torch.empty(_COPY_BYTES, dtype=torch.uint8, pin_memory=True)
    up = _COPY_BYTES / fastest_seconds(lambda: target.copy_(host, non_blocking=True))
    down = _COPY_BYTES / fastest_seconds(lambda: host.copy_(target, non_blocking=True))
    del source, target
    conv, matmul = {}, {}
    for dtype in _DTYPES:
        a = torch.full((_MATMUL_SIZE, _MATMUL_SIZE), 0.5, dtype=dtype, device=device)
        matmul[str(dtype).removeprefix("torch.")] = \
            2 * _MATMUL_SIZE ** 3 / fastest_seconds(lambda: a @ a)
        n, c, h, w = _CONV
        x = torch.full(_CONV, 0.5, dtype=dtype, device=device)
        weight = torch.full((c, c, 3, 3), 0.01, dtype=dtype, device=device)
        conv[str(dtype).removeprefix("torch.")] = \
            2 * n * c * c * 9 * h * w / fastest_seconds(lambda: F.conv2d(x, weight, padding=1))
    return Machine(memory, conv, matmul, min(up, down),
                   source=f"measured on {torch.cuda.get_device_name(device)}")
