"""Recomputation segments at run time: what a segment needs to replay itself, and the replay.

Rule 1: a segment's forward keeps nothing autograd saved; it keeps its inputs (kept or pooled),
        the random-number state and the autocast state it ran under, and a copy of the model
        state it reads that some layer writes in place (a replay must read it as it was),
        except state no output of the segment depends on (blind_state).
Rule 2: a replay runs the segment's layers again from those inputs with the same random numbers,
        and leaves the model's state as the forward left it (BatchNorm's running statistics move
        once a step): state read by get_attr is replayed on copies, or on stand-ins where no
        output depends on it (a batch norm's statistics in training); a torch batch norm leaf in
        training writes stand-ins too, and other leaf modules' buffers are put back.
Rule 3: speed-centric replays once, up to the last layer still needed, and keeps all it makes
        until read; memory-centric replays the prefix one backward layer needs, each time.
"""

import contextlib
import weakref

import torch
from torch import nn
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


# torch's own batch norms, whose forward is known: in training their output reads the batch's
# statistics alone and they write the running ones; in eval they write nothing
_TORCH_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_RUNNING = ("running_mean", "running_var", "num_batches_tracked")


def stand_in(key, real: torch.Tensor, made: dict) -> torch.Tensor:
    """A tensor like ``real`` for a replay to write instead of it (made once per ``key`` and
    tensor): zeros, so that a step count read as a number divides by one and up."""
    seen = made.get(key)
    if seen is None or seen[0] is not real:
        seen = made[key] = (real, torch.zeros_like(real))
    return seen[1]


def blind_state(state: list, layers: list) -> set:
    """Of the written ``state`` (get_attr nodes) a segment's ``layers`` (fx nodes) read, those
    no output of theirs depends on: read only as the running statistics of a batch norm in
    training, or written in place by a layer whose result nothing reads (a step count's
    add_). A replay may give those layers stand-ins: what they write is not kept."""
    inside = set(layers)
    return {node for node in state
            if all(_blind_use(node, use) for use in node.users if use in inside)}


def _blind_use(state, use) -> bool:
    if use.kwargs:
        return False
    args = use.args
    if use.target is torch.ops.aten.batch_norm.default:
        # (input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn)
        return len(args) > 5 and args[5] is True and state not in args[:3] and \
            state not in args[5:]
    op = getattr(use.target, "__name__", "").split(".")[0]
    in_place = op.endswith("_") and not op.startswith("__")
    return in_place and not use.users and bool(args) and args[0] is state and \
        state not in args[1:]


@contextlib.contextmanager
def restored_buffers(modules: list, stand_ins: dict):
    """Rule 2: a replay must leave running statistics as the first forward left them, their
    version included: a buffer the forward saved for backward is checked for writes since
    (executor Rule 7), and restoring it is none. A torch batch norm in training writes
    stand-ins instead (``stand_ins``: those made so far, by module): its own buffers are not
    touched, and nothing is copied (a copy and its restoring cost the host a kernel launch
    each, per buffer and replay); in eval it writes nothing. Any other module's buffers are
    copied and put back."""
    swapped, saved = [], []
    with torch.no_grad():
        for module in dict.fromkeys(modules):    # a module called twice in a segment: once
            if type(module) in _TORCH_BATCH_NORMS:
                if module.training and module.track_running_stats:
                    swapped.append((module, dict(module._buffers)))
                    module._buffers.update({
                        name: stand_in((module, name), module._buffers[name], stand_ins)
                        for name in _RUNNING if module._buffers.get(name) is not None})
                continue
            saved.extend((b, b.clone()) for b in module._buffers.values() if b is not None)
    try:
        yield
    finally:
        for module, buffers in swapped:
            module._buffers.update(buffers)
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
