"""Pinned host pages the Tensor Pool's host store maps and registers itself (host.py's chunks).

Rule 1: a chunk is an anonymous private mapping advised to use 2 MiB pages (where the kernel's
        transparent huge pages allow it), touched on torch's threads, then registered with CUDA.
        Registering 2 MiB pages locks 512 times fewer pages than 4 KiB ones: in one device
        command on the H200's host, 31.75 GiB in chunks doubling from 256 MiB pinned at 14.8
        GiB/s this way, 9.1 without the advice, and 4.1 through PyTorch's pinned allocator
        registering on 16 threads (benchmarks/results/pinning_hugepages_2.json). Where the
        system has no such mappings (not Linux), PyTorch's pinned allocator pins the chunk.
Rule 2: a chunk is unregistered when the store gives it back (host Rule 5), once the store's
        device has finished the copies that may read or write it. Where that device cannot be
        waited for now (a CUDA graph being captured, a failed wait), and for a store collected
        unclosed (a finalizer may run in any thread, during another thread's graph capture,
        which a device-wide wait would break), the chunks wait to be given back at the next
        give-back or new chunk. Until CUDA has unregistered it this module holds the chunk's
        mapping: pages unmapped while registered leave CUDA a registration that later copies
        from whatever is mapped at those addresses meet (a pageable copy failed with
        cudaErrorAlreadyMapped in the GPU suite when a collected store's pages went with their
        last tensor). Once unregistered, the pages return to the system when the last tensor
        viewing them is freed. The user's own pinned tensors are left to PyTorch's allocator
        and its settings: the store neither changes those settings nor empties that cache.
Rule 3: a registration the system refuses (a memlock limit) leaves CUDA's last error set, which
        PyTorch's next kernel launch would raise as its own: it is read off at once, and the
        chunk is used as pageable memory.
Rule 4: forked processes (DataLoader workers) do not inherit the mappings (MADV_DONTFORK): the
        kernel would copy registered pages into each child at once. A child keeps its Python
        copies of them for its life and calls no CUDA for them: unmapping one there would
        unmap whatever the child has mapped at that address since.
"""

import mmap
import os
import weakref

import torch

from . import host_memory

MAPPABLE = hasattr(mmap, "MAP_ANONYMOUS")
_PORTABLE = 1                      # cudaHostRegisterPortable: pinned for every device's context
_registered: dict = {}             # Rule 2: a registered chunk's address -> its mapping
_pending: list = []                # Rule 2: (chunks, device) left to give back
_mapped = weakref.WeakSet()        # Rule 4: every mapping made here
_in_child: list = []               # Rule 4: in a forked child, the mappings it inherited


def pinned_chunk(num_bytes: int) -> tuple | None:
    """A chunk of ``num_bytes`` mapped here (MAPPABLE): (tensor, whether CUDA registered it), or
    None where the host has not that much memory available (MemAvailable: touching pages the
    host does not have would bring the kernel's out-of-memory killer rather than an error; the
    caller asks for less, host Rule 3)."""
    if _pending:
        give_back([], None)
    available = host_memory.available_host_bytes()
    if available is not None and num_bytes > available:
        return None
    try:
        area = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return None
    _mapped.add(area)
    for advice in ("MADV_DONTFORK", "MADV_HUGEPAGE"):      # Rules 4 and 1
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


def give_back(chunks: list, device: torch.device | None) -> None:
    """Rule 2: ``chunks`` and those left pending are unregistered once their device (None: no
    CUDA copies) has finished; where it cannot be waited for now, they stay pending."""
    if _in_child:
        return
    work = [(chunks, device)] if chunks else []
    while _pending:                       # pop, not copy and clear: a finalizer may append
        work.append(_pending.pop())
    for chunks, device in work:
        if not _device_finished(device):
            _pending.append((chunks, device))
            continue
        for chunk in chunks:
            unregister(chunk)


def give_back_later(chunks: list, device: torch.device | None) -> None:
    """Rule 2 for a store collected unclosed: no CUDA call from a finalizer."""
    if chunks and not _in_child:
        _pending.append((chunks, device))


def _device_finished(device: torch.device | None) -> bool:
    if device is None:
        return True
    try:
        if torch.cuda.is_current_stream_capturing():
            return False
        torch.cuda.synchronize(device)          # that device alone: no context elsewhere
        return True
    except RuntimeError:
        return False


def _forked() -> None:
    """Rule 4, in a forked child."""
    _in_child.extend(_mapped)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def _read_off_last_error() -> None:
    """Rule 3: a kernel launch checks CUDA's last error (and so resets it); the error raised
    here is the refused registration's."""
    try:
        torch.zeros(1, device="cuda")
    except RuntimeError:
        pass
