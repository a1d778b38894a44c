"""A reusable host slab: one (pinned) allocation, carved into regions for offloaded tensors.

Pinned allocation synchronizes the device and is slow, so it happens once per plan (and again
only if the slab must grow); regions are handed out first-fit and returned for reuse. A region
whose host-to-device copy may still be running is reused only once that copy has finished.
Where the system will not pin that much (the slab for Inception-v4's offloads at batch 400, which
PyTorch rounds up to a power of two, failed on a 128 GiB machine: benchmarks/results/
diagnose_inception_v4_1_before.json), the slab is smaller and the rest comes from separate buffers,
pageable as a last resort: slower copies rather than a failed step.
"""

import torch

_ALIGN = 512


def host_buffer(num_bytes: int, pin: bool) -> torch.Tensor:
    """A host buffer, pinned if the system allows it, else pageable."""
    if pin:
        try:
            return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError:
            pass
    return torch.empty(num_bytes, dtype=torch.uint8)


class HostSlab:
    def __init__(self, pin: bool):
        self.pin = pin
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.free: list = []            # [(offset, size)], sorted by offset
        self.deferred: list = []        # [(offset, size, event)]: reusable once event completes

    @property
    def capacity(self) -> int:
        return self.buffer.numel()

    def reserve(self, num_bytes: int, at_least: int = 0) -> None:
        """Make the slab ``num_bytes`` large, or as large as the system will pin down to
        ``at_least``; only valid while no region is in use."""
        if num_bytes <= self.capacity:
            return
        # PyTorch's pinned allocator rounds every request up to a power of two: ask for one,
        # and the slab uses all that is page-locked (40 GiB asked would pin 64 anyway)
        size = 1 << (num_bytes - 1).bit_length() if self.pin else num_bytes
        while True:
            try:
                self.buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
                break
            except RuntimeError:                     # page-locking refused
                size //= 2
                if size < max(at_least, 1):          # none pinned: all pageable
                    self.buffer = torch.empty(num_bytes, dtype=torch.uint8)
                    break
        self.free, self.deferred = [(0, self.buffer.numel())], []

    def alloc(self, num_bytes: int) -> torch.Tensor | None:
        size = -(-num_bytes // _ALIGN) * _ALIGN
        for attempt in range(2):
            for index, (offset, free_size) in enumerate(self.free):
                if free_size >= size:
                    if free_size == size:
                        del self.free[index]
                    else:
                        self.free[index] = (offset + size, free_size - size)
                    return self.buffer[offset:offset + num_bytes]
            if attempt == 0 and not self._reclaim(wait=True):
                break
        return None

    def release(self, region: torch.Tensor, event=None) -> None:
        offset = region.storage_offset()
        size = -(-region.numel() // _ALIGN) * _ALIGN
        if event is not None and not event.query():
            self.deferred.append((offset, size, event))
        else:
            self._insert(offset, size)

    def _reclaim(self, wait: bool) -> bool:
        if not self.deferred:
            return False
        for offset, size, event in self.deferred:
            if wait:
                event.synchronize()
            self._insert(offset, size)
        self.deferred = []
        return True

    def _insert(self, offset: int, size: int) -> None:
        self.free.append((offset, size))
        self.free.sort()
        merged = []
        for start, length in self.free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        self.free = merged
