"""Convolution workspaces sized to the room the budget leaves (executor Rule 9).

PyTorch's cuDNN convolutions take, per shape and thread, the first engine in cuDNN's heuristic
order whose workspace the caching allocator can give, and keep it; a kept engine whose
workspace cannot be allocated is dropped and chosen again. Left alone, workspaces take what the
device, or the caller's own memory fraction, allows: not what the budget leaves. ResNet-50 at
1.5 GiB in a 2 GiB cap took a 412 MiB workspace in a backward convolution, and every step peaked
at 1.72 GiB.

So while a plan calibrates (its first steps, executor Rule 4), and at every step once one passed
the budget, each convolution, forward or backward, runs with the allocator limited to the
budget (less the calibration's slack): its outputs and a workspace in the room beside them, or
with no room, the outputs alone (_limit says how). Its free cached blocks are returned first
when they are more than the room beside the outputs: the limit bounds what the allocator
reserves anew, and a cached block would serve a workspace past it. A backward
convolution's limit starts before its node runs and is lifted while the node brings its saved
tensors back. The engines chosen or kept then fit the room of a calibrated step, and later steps
run them again, at no cost; where a later step still passed the budget, every step after it is
fitted (executor Rule 9; ResNet-101 at batch 896 peaked 855 MiB above its calibrating steps:
its host ran ahead of the device and the engines kept took the room of offloads still in
flight, which executor Rule 10 now frees before each convolution). A forward convolution that
runs out of memory under its limit runs again without it (executor Rule 9).

Limits: the allocator's fraction is per process and device, so while a convolution runs under
it, so does anything another thread allocates on that device; and cuDNN keeps its engines per
thread, so a forward run on a thread of its own each call (nn.DataParallel's replicas) chooses
them after calibration, unfitted, unless a step passed the budget.
"""

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .allocator_cap import available as fraction_readable, deterministic_kernels
from .near_limit import own_limit_began, own_limit_ended

# what the caching allocator reserves anew for a request (CUDACachingAllocator.cpp): requests
# up to 1 MiB share 2 MiB segments; a larger one takes a 20 MiB segment below 10 MiB, else its
# size in 2 MiB pages, and with expandable segments the segment grows by 20 MiB at a time, so a
# multiple of 20 MiB covers both
_SMALL, _SMALL_SEGMENT, _LARGE_SEGMENT = 2**20, 2 * 2**20, 20 * 2**20


def segment_bytes(nbytes: int) -> int:
    """At most what the allocator reserves anew to allocate ``nbytes``."""
    if nbytes <= _SMALL:
        return _SMALL_SEGMENT
    return -(-nbytes // _LARGE_SEGMENT) * _LARGE_SEGMENT


def fits_on(device: torch.device) -> bool:
    """Whether workspaces can be fitted on ``device``: CUDA, with a torch that says what the
    caller's own memory fraction is (to give it back). Not under deterministic kernels: an
    engine chosen within less memory than plain PyTorch has may round differently from the
    one plain chooses, and such a caller compares bits. A workspace then takes what the device
    allows, and a step it takes past the budget is warned about (untouched.py Rule 4)."""
    return device.type == "cuda" and fraction_readable() and not deterministic_kernels()


def grad_bytes(tensors) -> list:
    """The bytes of the gradients ``tensors`` get in backward: those of the ones that need one."""
    return [t.numel() * t.element_size() for t in tensors
            if isinstance(t, torch.Tensor) and t.requires_grad]


def _stats(index: int) -> tuple:
    """(allocated, reserved, retries) from one read of the allocator's statistics."""
    stats = torch.cuda.memory_stats_as_nested_dict(index)
    return (stats["allocated_bytes"]["all"]["current"], stats["reserved_bytes"]["all"]["current"],
            stats.get("num_alloc_retries", 0))


_DENSE_LAYOUTS = ((torch.contiguous_format, None), (torch.channels_last, 4),
                  (torch.channels_last_3d, 5))         # (memory format, its dimensions)


def _layout(tensor: torch.Tensor):
    """The memory format ``tensor`` is dense in (cuDNN copies a gradient reaching a
    convolution into its output's), else its strides."""
    for layout, dims in _DENSE_LAYOUTS:
        if dims in (None, tensor.dim()) and tensor.is_contiguous(memory_format=layout):
            return layout
    return tensor.stride()


def _laid_out(tensor: torch.Tensor, layout) -> bool:
    """Whether ``tensor`` is laid out as ``_layout`` said (a size-1 dimension's stride is
    free in a memory format)."""
    if isinstance(layout, tuple):
        return tensor.stride() == layout
    return tensor.is_contiguous(memory_format=layout)


class FitOutOfMemory(torch.OutOfMemoryError):
    """A convolution ran out of device memory under its workspace limit (executor Rule 9)."""


@dataclass
class _Running:
    """A backward convolution running under its limit."""
    fit: "WorkspaceFit"
    output_bytes: list
    caller: float             # the fraction its limit replaced (rebase() updates it)


# per CUDA device index, the backward convolution running under its limit there. Kept per
# device, not per fit: a backward that raised inside one executor's convolution left its limit,
# and the next wrapped forward outside any backward, whichever runs it, gives the caller's back
_running: dict = {}


def end_stale() -> None:
    """Where no backward runs now, give back the caller's fraction that a backward
    convolution's limit replaced, on every device where one is left (its node raised, so its
    hook never ran). Each wrapped forward calls it (module.py)."""
    if not _running or torch._C._current_graph_task_id() != -1:
        return
    for index in list(_running):
        _end(index)


def rebase(index: int, fraction: float) -> None:
    """A strict budget's hold began or ended (allocator_cap.py): a backward convolution's limit
    left on ``index`` gives back ``fraction`` now, not the one the hold replaced (a stale limit
    would otherwise restore a released hold's budget for good)."""
    if index in _running:
        _running[index].caller = fraction


def _end(index: int) -> None:
    running = _running.pop(index, None)
    if running is not None:
        torch.cuda.set_per_process_memory_fraction(running.caller, index)
        own_limit_ended(index)


class WorkspaceFit:
    """One executor's convolutions, fitted to its budget on one CUDA device."""

    def __init__(self, device: torch.device, budget_bytes: int, slack_bytes: int):
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.total = torch.cuda.get_device_properties(self.index).total_memory
        self.budget_bytes, self.slack_bytes = budget_bytes, slack_bytes

    @contextmanager
    def fitted(self, output_bytes: list):
        """Run a convolution whose results are ``output_bytes`` with its workspace fitted."""
        caller = self._limit(output_bytes)
        try:
            yield
        finally:
            torch.cuda.set_per_process_memory_fraction(caller, self.index)
            own_limit_ended(self.index)

    def through_backward(self, out, gradient_bytes: list) -> None:
        """Fit the workspaces of ``out``'s convolution backward too, whose results are
        ``gradient_bytes`` and, where the gradient reaching it is not dense in ``out``'s
        memory format (a sum's backward hands on an expanded one), the copy cuDNN makes of it
        in that format. That copy is counted only where it is made: counted otherwise, it
        takes the limit's room, and a limit without room is what the allocator reserves plus
        the results' segments, which a workspace may take past the budget. Only PyTorch's own
        convolution node: another node's allocations are not known here."""
        node = getattr(out, "grad_fn", None)
        if node is None or type(node).__name__ != "ConvolutionBackward0":
            return
        # the layout and size, not ``out``: the node must not keep its own output alive
        layout, copy_bytes = _layout(out), out.numel() * out.element_size()

        def begins(grad_outputs):
            grad = grad_outputs[0] if grad_outputs else None
            copied = grad is not None and not _laid_out(grad, layout)
            self._backward_begins(gradient_bytes + [copy_bytes] * copied)
        node.register_prehook(begins)
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
        running = _running[self.index]
        torch.cuda.set_per_process_memory_fraction(running.caller, self.index)
        own_limit_ended(self.index)
        try:
            yield
        finally:
            if _running.get(self.index) is running:
                running.fit._limit(running.output_bytes)

    def _backward_begins(self, gradient_bytes: list) -> None:
        _end(self.index)                     # a backward that raised left its limit
        caller = self._limit(gradient_bytes)
        _running[self.index] = _Running(self, gradient_bytes, caller)

    def _limit(self, output_bytes: list) -> float:
        """Limit the allocator for one convolution; returns the fraction to give back.

        With R reserved and A allocated now, results O and room W = budget - slack - A - O,
        the limit is the larger of the budget less the slack (the results are allocated under
        the limit too, and a workspace gets at most W, blocks cached free included) and R +
        what O's requests reserve at most (the results always fit, where O counts them all;
        without room a workspace gets at most their rounding, under 20 MiB a result, within
        the slack of any budget above 1 GiB), with one small segment more there. Where more
        than W is cached free, the cache is emptied first (only its wholly free segments go
        back)."""
        caller = torch.cuda.get_per_process_memory_fraction(self.index)
        allocated, reserved, retries = _stats(self.index)
        room = max(0, self.budget_bytes - self.slack_bytes - allocated - sum(output_bytes))
        if reserved - allocated > room:
            torch.cuda.empty_cache()
            allocated, reserved, retries = _stats(self.index)
        # without room, one small segment beyond the results': a kernel's own small requests
        # (at most 1 MiB, which a workspace above that never takes) may need one where the
        # small ones are full. With room they come out of it, so the budget bounds the limit.
        limit = max(self.budget_bytes - self.slack_bytes,
                    reserved + sum(segment_bytes(n) for n in output_bytes) + _SMALL_SEGMENT)
        torch.cuda.set_per_process_memory_fraction(min(caller, limit / self.total), self.index)
        own_limit_began(self.index, retries)         # near_limit.py: not the device's limit
        return caller
