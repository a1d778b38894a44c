"""Copies between device and host: on CUDA on their own streams, ordered by events.

Rule 1: an offload waits for the compute that produced the tensor; the caller keeps the device
        bytes until the offload's event has completed, or the compute stream waits for it
        (Rule 3), and only then frees them (freeing them early with record_stream made the
        allocator retry and synchronize every stream when it was short of memory: 7 times a
        step, profile_before.json).
Rule 2: a prefetch allocates from the compute stream's memory, where the tensor is read and freed
        (the allocator keeps memory per stream: blocks freed on the copy stream would be stranded
        there), waits for the compute queued before it (that memory may have just been freed by
        it) and for the offload of the same bytes; its user waits on the prefetch's event. So
        its bytes are freed on the compute stream after the copy, and the allocator may reuse
        them at once. One freed unread (a prefetch that gives way, or is dropped) is freed
        behind a wait of the compute stream for its copy (``abandon``), not marked with
        record_stream: that would keep every prefetched block from reuse until the copy
        stream had run all it held when the block was freed, the prefetches queued ahead
        included, and the allocator, short of memory, would free its cache and wait for the
        device instead.
Rule 3: the device bytes of an offload still in flight may be freed at once if the compute stream
        first waits for its event: the allocator hands them only to what that stream (and a
        prefetch, which waits for that stream: Rule 2) runs after the copy. The host goes on
        queueing layers instead of waiting for the copy, and the device runs them when it ends.
On the CPU the same calls copy synchronously, so the pool's logic runs and is tested anywhere.
"""

import torch


class Mover:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.d2h = torch.cuda.Stream(device)
            self.h2d = torch.cuda.Stream(device)

    def to_host(self, device_bytes: torch.Tensor, host_bytes: torch.Tensor, after=None):
        """Start copying ``device_bytes`` into ``host_bytes`` once the event ``after`` (if
        any) has completed; returns an event or None. Keep ``device_bytes`` until the event has
        completed (Rule 1)."""
        if not self.cuda:
            host_bytes.copy_(device_bytes)
            return None
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))      # Rule 1
        if after is not None:
            self.d2h.wait_event(after)
        with torch.cuda.stream(self.d2h):
            host_bytes.copy_(device_bytes, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.d2h)
        return event

    def to_device(self, host_bytes: torch.Tensor, after=None):
        """Start copying ``host_bytes`` back; returns (device tensor, event or None)."""
        if not self.cuda:
            return host_bytes.clone(), None
        device_bytes = torch.empty(host_bytes.numel(), dtype=torch.uint8, device=self.device)
        self.h2d.wait_stream(torch.cuda.current_stream(self.device))       # Rule 2
        with torch.cuda.stream(self.h2d):
            if after is not None:
                self.h2d.wait_event(after)
            device_bytes.copy_(host_bytes, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.h2d)
        return device_bytes, event

    def abandon(self, event) -> None:
        """Let the bytes of a prefetch not read be freed now (Rule 2): what the compute
        stream runs next, which the allocator may hand them to, waits for the copy."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def copies_in(self):
        """An event after every host-to-device copy queued so far (host.py Rule 4's fence)."""
        event = torch.cuda.Event()
        event.record(self.h2d)
        return event

    def reuse_after(self, event) -> None:
        """Let the device bytes an offload reads be freed now (Rule 3)."""
        torch.cuda.current_stream(self.device).wait_event(event)

    def ready(self, device_bytes: torch.Tensor, event) -> None:
        """Make the compute stream wait for a prefetch before it reads ``device_bytes``."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
