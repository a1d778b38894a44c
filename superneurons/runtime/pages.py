"""Pinned host pages the Tensor Pool's host store maps and registers itself (host.py's chunks).

Rule 1: a chunk is an anonymous private mapping advised to use 2 MiB pages (where the kernel's
        transparent huge pages allow it), touched on torch's threads, then registered with CUDA.
        Registering 2 MiB pages locks 512 times fewer pages than 4 KiB ones: in one device
        command on the H200's host, 31.75 GiB in chunks doubling from 256 MiB pinned at 14.8
        GiB/s this way, 9.1 without the advice, and 4.1 through PyTorch's pinned allocator
        registering on 16 threads (benchmarks/results/pinning_hugepages_2.json). Where the
        system has no such mappings (not Linux), PyTorch's pinned allocator pins the chunk.
Rule 2: a chunk is unregistered when the store gives it back (host Rule 5), once the store's
        device has finished the copies that may read or write it; while a CUDA graph is
        captured nothing may wait, so it stays registered. Until CUDA has unregistered it this
        module holds the chunk's mapping: pages unmapped while registered leave CUDA a
        registration that later copies from whatever is mapped at those addresses meet (a
        pageable copy failed with cudaErrorAlreadyMapped in the GPU suite when a collected
        store's pages went with their last tensor). Once unregistered, the pages return to the
        system when the last tensor viewing them is freed. Forked processes (DataLoader
        workers) do not inherit the mapping: the kernel would copy registered pages into each
        child at once. The user's own pinned tensors are left to PyTorch's allocator and its
        settings: the store neither changes those settings nor empties that cache.
Rule 3: a registration the system refuses (a memlock limit) leaves CUDA's last error set, which
        PyTorch's next kernel launch would raise as its own: it is read off at once, and the
        chunk is used as pageable memory.
"""

import mmap

import torch

from .host_memory import available_host_bytes

MAPPABLE = hasattr(mmap, "MAP_ANONYMOUS")
_PORTABLE = 1                      # cudaHostRegisterPortable: pinned for every device's context
_registered: dict = {}             # Rule 2: a registered chunk's address -> its mapping


def pinned_chunk(num_bytes: int) -> tuple | None:
    """A chunk of ``num_bytes`` mapped here (MAPPABLE): (tensor, whether CUDA registered it), or
    None where the host has not that much memory available (MemAvailable: touching pages the
    host does not have would bring the kernel's out-of-memory killer rather than an error; the
    caller asks for less, host Rule 3)."""
    available = available_host_bytes()
    if available is not None and num_bytes > available:
        return None
    try:
        area = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return None
    for advice in ("MADV_DONTFORK", "MADV_HUGEPAGE"):      # Rules 2 and 1
        try:
            area.madvise(getattr(mmap, advice))
        except (AttributeError, OSError):      # not this system's: the chunk works without
            pass
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


def unregister_after_the_device(chunks: list, device: torch.device | None) -> None:
    """Rule 2: ``device`` (None: no CUDA copies) is waited for first; where it cannot be, the
    chunks stay registered and mapped."""
    if not chunks:
        return
    if device is not None:
        try:
            if torch.cuda.is_current_stream_capturing():
                return
            torch.cuda.synchronize(device)          # that device alone: no context elsewhere
        except RuntimeError:
            return
    for chunk in chunks:
        unregister(chunk)


def _read_off_last_error() -> None:
    """Rule 3: a kernel launch checks CUDA's last error (and so resets it); the error raised
    here is the refused registration's."""
    try:
        torch.zeros(1, device="cuda")
    except RuntimeError:
        pass


