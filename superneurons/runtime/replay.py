"""Recomputation segments at run time: what a segment needs to replay itself, and the replay.

Rule 1: a segment's forward keeps nothing autograd saved; it keeps its inputs (kept or pooled),
        the random-number state and the autocast state it ran under, and a copy of the model
        state it reads that some layer writes in place (a replay must read it as it was).
Rule 2: a replay runs the segment's layers again from those inputs with the same random numbers,
        and leaves the model's state as the forward left it (BatchNorm's running statistics move
        once a step): state read by get_attr is replayed on copies, and the buffers of leaf
        modules are put back.
Rule 3: speed-centric replays once, up to the last layer still needed, and keeps all it makes
        until read; memory-centric replays the prefix one backward layer needs, each time.
"""

import contextlib
import weakref

import torch
from torch.autograd.grad_mode import _unsafe_preserve_version_counter

from ..planner import Strategy


class SegmentRecord:
    def __init__(self, executor, segment, inputs: dict, rng, autocast, state: dict):
        self._executor = weakref.ref(executor)   # no cycle: records die with their step
        self.segment = segment
        self.inputs = inputs             # fx node -> PoolRef, tensor or other object
        self.rng = rng                   # (cpu state, device state) or None
        self.autocast = autocast         # (device type, enabled, dtype)
        self.state = state               # get_attr node -> copy of state written in the step
        self.alive: dict = {}            # key -> number of handles waiting for it
        self.cache: dict = {}            # key -> replayed tensor
        self.sealed = False              # forward done: no new handles will come

    def hold(self, key) -> None:
        self.alive[key] = self.alive.get(key, 0) + 1

    def drop(self, key) -> None:
        count = self.alive.get(key, 0) - 1
        if count > 0:
            self.alive[key] = count
            return
        self.alive.pop(key, None)
        self.cache.pop(key, None)
        if not self.alive and self.sealed:
            self.inputs = None           # the segment is done: its inputs may go

    def take(self, key) -> torch.Tensor:
        if key not in self.cache:
            self._replay(key)
        return self.cache[key]

    def _layer_of(self, key) -> int:
        if key[0] == "value":
            return self._executor().plan.graph.values[key[1]].producer
        return key[0]

    def _replay(self, key) -> None:
        position = self._executor().segment_position[self.segment.index]
        if self.segment.strategy is Strategy.SPEED:
            wanted = {k for k in self.alive if k not in self.cache}
            last = max(position[self._layer_of(k)] for k in wanted)
        else:
            target = self._layer_of(key)
            wanted = {k for k in self.alive if self._layer_of(k) == target}
            last = position[target]
        self._executor().replay(self, last, wanted)


@contextlib.contextmanager
def restored_buffers(modules: list):
    """Rule 2: a replay must leave running statistics as the first forward left them, their
    version included: a buffer the forward saved for backward is checked for writes since
    (executor Rule 7), and restoring it is none."""
    saved = [(b, b.clone()) for m in modules for b in m._buffers.values()   # a module's own
             if b is not None]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, copy in saved:
                with _unsafe_preserve_version_counter(buffer):
                    buffer.copy_(copy)


@contextlib.contextmanager
def replayed_random(rng, device: torch.device):
    """Rule 2: the same random numbers as the forward, without disturbing the global stream."""
    if rng is None:
        yield
        return
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else [], enabled=True):
        torch.set_rng_state(rng[0])
        if cuda:
            torch.cuda.set_rng_state(rng[1], device)
        yield


def capture_rng(device: torch.device):
    cuda_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda_state


def capture_autocast(device: torch.device):
    kind = device.type
    return kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)
