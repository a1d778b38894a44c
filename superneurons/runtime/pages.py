"""Pinned host pages the Tensor Pool's host store maps and registers itself (host.py's chunks).

Rule 1: a chunk is an anonymous private mapping advised to use 2 MiB pages (where the kernel's
        transparent huge pages allow it), touched on torch's threads, then registered with CUDA.
        Registering 2 MiB pages locks 512 times fewer pages than 4 KiB ones: in one device
        command on the H200's host, 31.75 GiB in chunks doubling from 256 MiB pinned at 14.8
        GiB/s this way, 9.1 without the advice, and 4.1 through PyTorch's pinned allocator
        registering on 16 threads (benchmarks/results/pinning_hugepages_2.json). Where the
        system has no such mappings (not Linux), PyTorch's pinned allocator pins the chunk.
Rule 2: a chunk is unregistered when the store gives it back, once no copy reads it (host Rule
        5), or when a store never closed is collected, once the device has finished its work.
        Until then this module holds the chunk's mapping: pages unmapped while registered leave
        CUDA a registration that later copies from whatever is mapped at those addresses meet
        (a pageable copy failed with cudaErrorAlreadyMapped in the GPU suite when a collected
        store's pages went with their last tensor). Once unregistered, the pages return to the
        system when the last tensor viewing them is freed. The user's own pinned tensors are
        left to PyTorch's allocator and its settings: the store neither changes those
        settings nor empties that cache.
Rule 3: a registration the system refuses (a memlock limit) leaves CUDA's last error set, which
        PyTorch's next kernel launch would raise as its own: it is read off at once, and the
        chunk is used as pageable memory.
"""

import mmap

import torch

MAPPABLE = hasattr(mmap, "MAP_ANONYMOUS")
_PORTABLE = 1                      # cudaHostRegisterPortable: pinned for every device's context
_registered: dict = {}             # Rule 2: a registered chunk's address -> its mapping


def pinned_chunk(num_bytes: int) -> tuple | None:
    """A chunk of ``num_bytes`` mapped here (MAPPABLE): (tensor, whether CUDA registered it), or
    None where the host has not that much memory available (the caller asks for less, host
    Rule 3)."""
    if num_bytes > _available():
        return None
    try:
        area = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return None
    if hasattr(mmap, "MADV_HUGEPAGE"):
        area.madvise(mmap.MADV_HUGEPAGE)
    chunk = torch.frombuffer(area, dtype=torch.uint8)   # keeps the mapping while it lives
    chunk.fill_(0)                                      # the page faults, on torch's threads
    registered = _register(chunk)
    if registered:
        _registered[chunk.data_ptr()] = area
    return chunk, registered


def _register(chunk: torch.Tensor) -> bool:
    error = torch.cuda.cudart().cudaHostRegister(chunk.data_ptr(), chunk.numel(), _PORTABLE)
    if int(error) == 0:
        return True
    _read_off_last_error()                                                  # Rule 3
    return False


def unregister(chunk: torch.Tensor) -> None:
    """Rule 2: the pages are pageable again (no copy may read them any more); where CUDA
    refuses, they stay mapped."""
    if int(torch.cuda.cudart().cudaHostUnregister(chunk.data_ptr())) != 0:
        _read_off_last_error()
        return
    _registered.pop(chunk.data_ptr(), None)


def unregister_after_the_device(chunks: list) -> None:
    """Rule 2 for a store collected unclosed: copies into and out of its chunks may still run.
    While a CUDA graph is captured nothing may wait: the chunks stay registered and mapped."""
    if not chunks or torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return
    for index in range(torch.cuda.device_count()):
        torch.cuda.synchronize(index)
    for chunk in chunks:
        unregister(chunk)


def _read_off_last_error() -> None:
    """Rule 3: a kernel launch checks CUDA's last error (and so resets it); the error raised
    here is the refused registration's."""
    try:
        torch.zeros(1, device="cuda")
    except RuntimeError:
        pass


def _available() -> int:
    """MemAvailable (Linux), else no bound: touching pages the host does not have would bring
    the kernel's out-of-memory killer rather than an error."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62
