"""Pinned host memory in 2 MiB pages, mapped and registered here (host.py Rule 6).

PyTorch pins a block by touching it page by page on its threads and registering it with CUDA:
8.4 GiB/s with 16 threads on the H200's host, in 4 KiB pages. The same 40 GiB, mapped here
with madvise(MADV_HUGEPAGE), touched on torch's threads and registered with cudaHostRegister,
pinned at 16.9 GiB/s: a fault and a page to lock per 2 MiB, not per 4 KiB. Where the kernel
gave no huge pages (no madvise), the same path pinned at 11.3 GiB/s
(benchmarks/results/pinning_hugepages.json). Copies from it ran at the link's 55 GB/s.

Rule 1: a mapping is unregistered before it is unmapped, when the last tensor on it goes (its
        storage holds the mapping): a range unmapped while registered would stay registered
        in the driver, and a later mapping at that address could not be pinned.
"""

import mmap

import torch


class _Mapping(mmap.mmap):
    """An anonymous mapping that unregisters itself from CUDA before it is unmapped (Rule 1)."""

    address = None

    def __del__(self):
        if self.address is not None:
            try:
                torch.cuda.cudart().cudaHostUnregister(self.address)
            except Exception:  # noqa: BLE001 -- at interpreter exit CUDA may be gone already
                pass


def maps_itself() -> bool:
    """Whether pinned memory is mapped here: CUDA, and a system with anonymous mappings."""
    return torch.cuda.is_available() and hasattr(mmap, "MAP_ANONYMOUS") and \
        hasattr(torch.cuda.cudart(), "cudaHostRegister")


def mapped_pinned(num_bytes: int) -> torch.Tensor:
    """``num_bytes`` of pinned host memory as a uint8 tensor; a RuntimeError where the system
    will not map or pin them (as PyTorch's pinned allocator raises)."""
    try:
        area = _Mapping(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, OverflowError) as error:
        raise RuntimeError(f"could not map {num_bytes} bytes of host memory: {error}") from error
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            area.madvise(mmap.MADV_HUGEPAGE)
        except OSError:          # a kernel without transparent huge pages: 4 KiB pages
            pass
    buffer = torch.frombuffer(area, dtype=torch.uint8)
    # the pages' faults on torch's threads: cudaHostRegister would take them one at a time
    buffer.zero_()
    error = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), num_bytes, 0)
    if int(error) != 0:
        raise RuntimeError(f"could not pin {num_bytes} bytes of host memory: {error}")
    area.address = buffer.data_ptr()
    return buffer
