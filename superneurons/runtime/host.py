"""Host memory for offloaded tensors: pinned chunks, taken as offloads need them, carved into
regions first-fit and returned for reuse.

Rule 1: memory is pinned when an offload needs it, never for all a plan could offload. Pinning
        takes host time in proportion to its bytes and synchronizes the device: first steps that
        pinned a slab up front for all their plan could offload (64 GiB for DenseNet-BC 1204 at
        a 5 GiB budget, 16 GiB at 11.5) spent 41.5 and 8.5 s of host time in `torch.empty`
        (benchmarks/results/profile_first_step.json, planner_costs_densenet_host_before.json).
        Each new chunk doubles what is pinned, up to MAX_CHUNK_BYTES.
Rule 2: chunks are powers of two: from 2 MiB up, whole huge pages where the kernel aligns the
        mapping to them (pages.py), and PyTorch's pinned allocator, where it pins them, rounds
        every request up to one, so all that is page-locked is used.
Rule 3: where the host has not the memory for a chunk, a smaller one is tried, down to the
        region's own size, then pageable memory; where it gives the memory but will not pin it
        (pages.py Rule 3), the chunk is used pageable. Either way no more is pinned: slower
        copies rather than a failed step
        (Inception-v4's offloads at batch 400 could not all be pinned on a 128 GiB machine:
        benchmarks/results/diagnose_inception_v4_1_before.json).
Rule 4: a region whose host-to-device copy may still be running is reused only once that copy
        has finished. With a fence (on CUDA, the mover's), the host does not wait for it: the
        copy into a region handed out after such regions were taken back waits, on the device,
        for every host-to-device copy queued before (one stream carries them, in order). The
        host waited at every offload that found no free region (cudaEventSynchronize, 13-21 ms
        of a 160-310 ms step, benchmarks/results/profile_ratio.json), and a host that waits
        for the device leaves it idle once it runs again.
Rule 5: a closed store gives its chunks back: at once those no region is carved from, the others
        when their last region returns (a handle of a step in flight still reads it); one
        collected without being closed, then. A store is closed when its plan is dropped
        (module.py Rule 5), rarely: a new plan captures again, which costs more than pinning
        again. Chunks mapped here are unregistered (pages.py Rule 2) once the store's device
        has finished: a plan is dropped, or its executor freed with its step's graph, as soon
        as backward returns on the host, while the device may still copy a region's bytes; a
        collected store's, at the next give-back or new chunk.
        Where PyTorch's pinned allocator pinned them, those given back at once have their
        pages returned to the system (the allocator would keep them cached, page-locked, for
        the life of the process), which empties its whole cache, the user's unused blocks (a
        DataLoader's) included; the others go back to that cache.
Rule 6: where PyTorch's pinned allocator pins (not Linux; and the state tier, state.py), the
        store first has it map the pages on PINNING_THREADS threads and then register them
        (pinned_use_cuda_host_register), unless the user set any pinned option: cudaHostAlloc
        pins 1.85 GiB/s on the H200's host, so a first step pinning 65 GiB spent half a minute
        there; registering pins 7.1 GiB/s with 8 threads set at run time and 8.8 with 16
        (benchmarks/results/pinning.json). The setting is the process's: the user's own
        pinned tensors (a DataLoader's) pin faster too.
"""

import logging
import os
import time
import warnings
import weakref

import torch

from . import pages
from ..units import format_bytes

log = logging.getLogger(__name__)   # INFO: pinning a chunk takes seconds; the CLI shows it

_ALIGN = 512
# threads that map pinned pages before registering them (Rule 6): 16 measured fastest of 8 and 16
PINNING_THREADS = 16
FIRST_CHUNK_BYTES = 256 << 20
MAX_CHUNK_BYTES = 8 << 30


class _Chunk:
    __slots__ = ("buffer", "pinned", "mapped", "free", "deferred")

    def __init__(self, buffer: torch.Tensor, pinned: bool, mapped: bool = False):
        self.buffer, self.pinned, self.mapped = buffer, pinned, mapped
        self.free = [(0, buffer.numel())]    # (offset, size), sorted by offset
        self.deferred = []                   # (offset, size, event): free once event completes

    @property
    def unused(self) -> bool:
        """No region is carved from it (nor waits for a copy)."""
        return not self.deferred and self.free == [(0, self.buffer.numel())]

    def carve(self, size: int, num_bytes: int) -> torch.Tensor | None:
        for index, (offset, free_size) in enumerate(self.free):
            if free_size >= size:
                if free_size == size:
                    del self.free[index]
                else:
                    self.free[index] = (offset + size, free_size - size)
                return self.buffer[offset:offset + num_bytes]
        return None

    def reclaim(self, wait: bool = True) -> bool:
        """Rule 4: free the deferred regions, after their copies when ``wait``; whether there
        were any."""
        deferred, self.deferred = self.deferred, []
        for offset, size, event in deferred:
            if wait:
                event.synchronize()
            self.insert(offset, size)
        return bool(deferred)

    def insert(self, offset: int, size: int) -> None:
        self.free.append((offset, size))
        self.free.sort()
        merged = []
        for start, length in self.free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        self.free = merged


class HostMemory:
    def __init__(self, pin: bool, first_chunk_bytes: int = FIRST_CHUNK_BYTES, fence=None,
                 device: torch.device | None = None):
        """``fence``: a callable returning an event after every host-to-device copy queued so
        far, or None (Rule 4). ``device``: where copies into and out of the chunks run (CUDA),
        waited for before chunks mapped here are given back (Rule 5)."""
        self.pin = pin
        self.device = device
        self.first_chunk_bytes = first_chunk_bytes
        self.fence = fence
        self._after = None                   # Rule 4: what copies into regions now wait for
        self.chunks: dict = {}               # data_ptr of a chunk's storage -> _Chunk
        self.closed = False
        self.taking_seconds = 0.0            # host time spent taking chunks (StepStats)
        # pages.py Rule 2; not at exit, where the process's pages go with it
        weakref.finalize(self, _collected, self.chunks, device).atexit = False

    @property
    def capacity(self) -> int:
        """Host bytes the store holds, pinned or not."""
        return sum(chunk.buffer.numel() for chunk in self.chunks.values())

    @property
    def pinned_bytes(self) -> int:
        return sum(chunk.buffer.numel() for chunk in self.chunks.values() if chunk.pinned)

    def alloc(self, num_bytes: int) -> torch.Tensor:
        """A region of ``num_bytes``, from a new chunk if no chunk has room (Rule 1)."""
        if self.closed:
            raise RuntimeError("host memory of a closed superneurons executor was asked for a "
                               "region; please report this")
        size = _aligned(num_bytes)
        for attempt in range(2):
            for chunk in self.chunks.values():
                region = chunk.carve(size, num_bytes)
                if region is not None:
                    return region
            # every chunk reclaims (a list, not any()'s short circuit)
            if attempt == 1:
                break
            wait = self.fence is None
            if not any([c.reclaim(wait) for c in self.chunks.values()]):
                break
            if not wait:
                self._after = self.fence()
        return self._grow(size).carve(size, num_bytes)

    def writes_after(self):
        """Rule 4: the event a copy into a region alloc() handed out must wait for, or None."""
        if self._after is not None and self._after.query():
            self._after = None
        return self._after

    def release(self, region: torch.Tensor, event=None) -> None:
        chunk = self.chunks[region.untyped_storage().data_ptr()]
        offset, size = region.storage_offset(), _aligned(region.numel())
        if event is not None and not event.query():
            if self.closed:             # Rule 5: the chunk goes as soon as its copy is done
                event.synchronize()
            else:
                chunk.deferred.append((offset, size, event))
                return
        chunk.insert(offset, size)
        if self.closed and chunk.unused:
            # the caller still holds the region: its pages go when it lets go (Rule 5)
            _give_back([self.chunks.pop(region.untyped_storage().data_ptr())], self.device)

    def close(self) -> None:
        """Rule 5: give back every chunk no region is carved from; the rest as they empty."""
        self.closed = True
        # comprehensions, not loops: a loop variable would keep the last chunk's pages alive
        [chunk.reclaim() for chunk in self.chunks.values()]
        unused = [self.chunks.pop(key) for key, chunk in list(self.chunks.items())
                  if chunk.unused]
        _give_back(unused, self.device)
        pinned_by_torch = any(chunk.pinned and not chunk.mapped for chunk in unused)
        del unused                  # their pages are free only once no chunk holds them
        if pinned_by_torch:
            _return_pinned_pages()

    def _grow(self, size: int) -> _Chunk:
        began = time.perf_counter()
        want = max(min(max(self.capacity, self.first_chunk_bytes), MAX_CHUNK_BYTES), size)
        want = 1 << (want - 1).bit_length()                                  # Rule 2
        buffer, pinned = None, self.pin
        log.info("taking %s of %s host memory for offloads (%s held)", format_bytes(want),
                 "pinned" if self.pin else "pageable", format_bytes(self.capacity))
        mapped = False
        while self.pin and want >= size:
            buffer, pinned, mapped = _pinned(want)
            if buffer is not None:
                break
            want //= 2                                                       # Rule 3
        if buffer is None:
            pinned = False
            buffer = _pageable(max(want, size), size, self.capacity)
        self.pin = self.pin and pinned
        chunk = _Chunk(buffer, pinned, mapped)
        self.chunks[buffer.untyped_storage().data_ptr()] = chunk
        self.taking_seconds += time.perf_counter() - began
        return chunk


def _give_back(chunks: list, device: torch.device | None) -> None:
    """Rule 5: chunks mapped here are unregistered once ``device`` has finished the copies
    that may still read or write them (pages.py Rule 2); PyTorch's go back to its pinned
    allocator as their tensors are freed."""
    pages.give_back(_registered(chunks), device)


def _collected(chunks: dict, device: torch.device | None) -> None:
    """A store collected without being closed (an executor freed with its step's graph, or
    dropped otherwise than with its plan): its chunks are given back at the next safe point
    (pages.py Rule 2)."""
    pages.give_back_later(_registered(chunks.values()), device)


def _registered(chunks) -> list:
    """The buffers of ``chunks`` that pages.py mapped and CUDA registered."""
    return [chunk.buffer for chunk in chunks if chunk.mapped and chunk.pinned]


def _pinned(num_bytes: int) -> tuple:
    """(chunk, pinned, mapped here), the chunk None where the system will not give that much."""
    if pages.MAPPABLE:
        taken = pages.pinned_chunk(num_bytes)                            # pages.py Rule 1
        return (*taken, True) if taken is not None else (None, False, False)
    _pin_with_threads()
    try:
        return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True), True, False
    except RuntimeError:
        return None, False, False


def _aligned(num_bytes: int) -> int:
    return -(-num_bytes // _ALIGN) * _ALIGN


def _pin_with_threads() -> None:
    """Rule 6, once a process. The user's own settings are kept: parsing settings again resets
    those it does not name, so the ones in force are named again."""
    global _pinning_set
    if _pinning_set:
        return
    _pinning_set = True
    settings = _allocator_settings()
    if "pinned_" in settings or not torch.cuda.is_available():
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = 1 << (min(PINNING_THREADS, cores or 1).bit_length() - 1)   # a power of two
    ours = f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{threads}"
    # the call measured in pinning.json (deprecated in later torch, for the one below)
    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None) or \
        getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    with warnings.catch_warnings():            # a deprecation warning must not end a step
        warnings.simplefilter("ignore")
        try:
            setter(",".join(filter(None, (settings, ours))))
        except Exception:  # noqa: BLE001 -- a torch without these options pins as before
            pass          # (a setter of None included)


def _allocator_settings() -> str:
    """The allocator settings in force: as PyTorch parsed them where it says, else as given in
    the environment (PYTORCH_ALLOC_CONF first, as PyTorch reads them)."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is not None:
        try:
            return getter()
        except Exception:  # noqa: BLE001 -- fall back to what the environment says
            pass
    return os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")


_pinning_set = False


def _return_pinned_pages() -> None:
    """Rule 5: PyTorch's pinned allocator frees its cached blocks that no tensor uses (a block a
    copy still reads is not free yet); a torch without this call keeps them cached."""
    empty_host_cache = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if empty_host_cache is not None:
        empty_host_cache()


def _pageable(want: int, size: int, held: int) -> torch.Tensor:
    """A pageable chunk of ``want`` bytes, else of ``size``; a clear error if the host has
    neither (rather than the allocator's, from inside autograd's hooks)."""
    for num_bytes in dict.fromkeys((want, size)):
        try:
            return torch.empty(num_bytes, dtype=torch.uint8)
        except RuntimeError as error:
            failure = error
    raise RuntimeError(
        f"out of host memory for offloaded tensors: {format_bytes(held)} held, "
        f"{format_bytes(size)} more needed. The parameters are unchanged (the optimizer has not "
        "stepped); zero the gradients, then raise the budget (less to offload) or lower the "
        "batch") from failure
