"""Convolution workspaces sized to the room the budget leaves (executor Rule 9).

PyTorch's cuDNN convolutions take, per shape and thread, the first engine in cuDNN's heuristic
order whose workspace the caching allocator can give, and keep it; a kept engine whose
workspace cannot be allocated is dropped and chosen again. Left alone, workspaces take what the
device, or the caller's own memory fraction, allows: not what the budget leaves. ResNet-50 at
1.5 GiB in a 2 GiB cap took a 412 MiB workspace in a backward convolution, and every step peaked
at 1.72 GiB.

So while a plan calibrates (its first steps, executor Rule 4), each convolution, forward or
backward, runs with the allocator limited to what it reserves now and the room the budget leaves
beside the convolution's outputs (_limit says how). Its free cached blocks are returned first
when they are more than that room: the limit bounds what the allocator reserves anew, and a
cached block would serve a workspace past it. A backward convolution's limit starts before its
node runs and is lifted while the node brings its saved tensors back. The engines chosen or kept
then fit the room of a calibrated step, and later steps run them again, at no cost.
"""

from contextlib import contextmanager

import torch

from .allocator_cap import available as fraction_readable

# the caching allocator's segment sizes (CUDACachingAllocator.cpp): requests up to 1 MiB
# share 2 MiB segments, up to 10 MiB 20 MiB ones, larger ones are rounded up to 2 MiB
_SMALL, _SMALL_SEGMENT = 2**20, 2 * 2**20
_MEDIUM, _MEDIUM_SEGMENT = 10 * 2**20, 20 * 2**20
_PAGE = 2 * 2**20


def segment_bytes(nbytes: int) -> int:
    """At most what the allocator reserves anew to allocate ``nbytes``."""
    if nbytes <= _SMALL:
        return _SMALL_SEGMENT
    if nbytes < _MEDIUM:
        return _MEDIUM_SEGMENT
    return -(-nbytes // _PAGE) * _PAGE


def available(device: torch.device) -> bool:
    """Whether workspaces can be fitted on ``device``: CUDA, with a torch that says what the
    caller's own memory fraction is (to give it back)."""
    return device.type == "cuda" and fraction_readable()


def _stats(index: int) -> tuple:
    stats = torch.cuda.memory_stats_as_nested_dict(index)
    return stats["allocated_bytes"]["all"]["current"], stats["reserved_bytes"]["all"]["current"]


def _tensor_bytes(tensors) -> list:
    return [t.numel() * t.element_size() for t in tensors
            if isinstance(t, torch.Tensor) and t.requires_grad]


# per CUDA device index, while a backward convolution runs under its limit: (its fit, its
# results' bytes, the fraction its limit replaced). Kept per device, not per fit: a backward
# that raised inside one executor's convolution left its limit, and the next forward outside any
# backward, whichever executor runs it, gives the caller's back (end_stale)
_running: dict = {}


def end_stale(device: torch.device) -> None:
    """Where no backward runs now, give back the caller's fraction a backward convolution's
    limit replaced, if one is left (its node raised, so its hook never ran)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _running and torch._C._current_graph_task_id() == -1:
        _end(index)


def _end(index: int) -> None:
    entry = _running.pop(index, None)
    if entry is not None:
        torch.cuda.set_per_process_memory_fraction(entry[2], index)


class WorkspaceFit:
    """One executor's convolutions, fitted to its budget on one CUDA device."""

    def __init__(self, device: torch.device, budget_bytes: int, slack_bytes: int):
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.total = torch.cuda.get_device_properties(self.index).total_memory
        self.budget_bytes, self.slack_bytes = budget_bytes, slack_bytes

    @contextmanager
    def fitted(self, outputs: list):
        """Run a convolution whose results are ``outputs`` bytes with its workspace fitted."""
        caller = self._limit(outputs)
        try:
            yield
        finally:
            torch.cuda.set_per_process_memory_fraction(caller, self.index)

    def through_backward(self, out, inputs: list) -> None:
        """Fit the workspaces of ``out``'s convolution backward too: its results are the
        gradients of ``inputs`` (the input, the weight, the bias) that need one."""
        node = getattr(out, "grad_fn", None)
        if node is None or "Convolution" not in type(node).__name__:
            return
        outputs = _tensor_bytes(inputs)
        node.register_prehook(lambda grad_outputs: self._backward_begins(outputs))
        node.register_hook(lambda grad_inputs, grad_outputs: _end(self.index))

    @property
    def limiting(self) -> bool:
        """Whether a backward convolution runs under its limit on this device now."""
        return self.index in _running

    @contextmanager
    def lifted(self):
        """While a backward convolution brings its saved tensors back (the pool's fetches and
        replays, which make their own room), the caller's limit; then the convolution's again,
        from what the allocator holds once they are back."""
        fit, outputs, caller = _running[self.index]
        torch.cuda.set_per_process_memory_fraction(caller, self.index)
        try:
            yield
        finally:
            if _running.get(self.index, (None,))[0] is fit:
                fit._limit(outputs)

    def _backward_begins(self, outputs: list) -> None:
        _end(self.index)                     # a backward that raised left its limit
        caller = self._limit(outputs)
        _running[self.index] = (self, outputs, caller)

    def _limit(self, outputs: list) -> float:
        """Limit the allocator for one convolution; returns the fraction to give back.

        With R reserved and A allocated now, outputs O and room W = budget - slack - A - O, the
        limit is R + max(W, O's segments): O always fits; a workspace then gets at most W of
        new memory (O served from free cached blocks), or less (O in new segments); and free
        cached blocks larger than W are returned first."""
        caller = torch.cuda.get_per_process_memory_fraction(self.index)
        allocated, reserved = _stats(self.index)
        room = max(0, self.budget_bytes - self.slack_bytes - allocated - sum(outputs))
        if reserved - allocated > room:
            torch.cuda.empty_cache()
            allocated, reserved = _stats(self.index)
        limit = reserved + max(room, sum(segment_bytes(n) for n in outputs))
        torch.cuda.set_per_process_memory_fraction(min(caller, limit / self.total), self.index)
        return caller
