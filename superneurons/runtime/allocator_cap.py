"""strict_budget: the budget as the caching allocator's own limit while a step's forward and
backward run (module Rule 8).

Plans hold the budget at layer boundaries. Between them, cuDNN's convolutions take workspaces
from whatever the caching allocator can give, up to the device (or the caller's own
set_per_process_memory_fraction), so a step could peak above its budget there. PyTorch drops a
convolution algorithm whose workspace it cannot allocate and runs one that needs less; with the
allocator's per-process fraction lowered to the budget, the workspaces fit in what the plan
leaves. The fraction limits reserved memory, which holds every allocated byte and the blocks
cached free besides, so the limit is at least as strict as the budget; when a request would
pass it, the allocator first returns its free cached blocks and tries again; blocks already
cached beyond it are returned when a step begins.

The caller's own fraction comes back when the forward returns and when its backward ends (an
autograd callback queued by a hook on the forward's outputs), so the loss, the optimizer's
step and whatever runs between steps keep the caller's limit: the first optimizer step makes
its state there, and the next forward plans beside it (module Rule 3) rather than running out
of memory inside the optimizer.

A backward that raises runs no callback; the limit then stays until the next forward of a
wrapper on that device returns.
"""

import torch
from torch.utils import _pytree as pytree

# per CUDA device index: (the caller's fraction, {holder id: the holder's fraction})
_held: dict = {}


def available() -> bool:
    """Whether this torch can say what the caller's own limit was, to give it back."""
    return hasattr(torch.cuda, "get_per_process_memory_fraction")


class AllocatorCap:
    """One wrapper's budget on one CUDA device, held while its steps run. Holders on the same
    device nest: the strictest fraction applies, the caller's comes back with the last."""

    def __init__(self, device: torch.device, budget_bytes: int):
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.total = torch.cuda.get_device_properties(self.index).total_memory
        self.fraction = min(1.0, budget_bytes / self.total)

    def hold(self) -> None:
        caller, holders = _held.get(self.index, (None, {}))
        if caller is None:
            caller = torch.cuda.get_per_process_memory_fraction(self.index)
        holders[id(self)] = self.fraction
        _held[self.index] = (caller, holders)
        fraction = min([caller, *holders.values()])
        _apply(self.index, fraction)
        # the limit bounds what the allocator reserves anew; blocks it already holds free
        # beyond it (a step or an evaluation before this one) would still serve workspaces
        if _reserved_bytes(self.index) > fraction * self.total:
            torch.cuda.empty_cache()

    def release(self) -> None:
        caller, holders = _held.get(self.index, (None, {}))
        if holders.pop(id(self), None) is None:
            return
        _apply(self.index, min([caller, *holders.values()]))
        if not holders:
            del _held[self.index]

    def through_backward(self, out) -> None:
        """Hold again from the first gradient that reaches ``out``'s tensors to the end of
        that backward."""
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(self._backward_begins)

    def _backward_begins(self, grad):
        if id(self) not in _held.get(self.index, (None, {}))[1]:
            self.hold()
            torch.autograd.Variable._execution_engine.queue_callback(self.release)
        return None


def _reserved_bytes(index: int) -> int:
    # as calibration.allocated_bytes: without flattening every statistic in Python
    return torch.cuda.memory_stats_as_nested_dict(index)["reserved_bytes"]["all"]["current"]


def _apply(index: int, fraction: float) -> None:
    if torch.cuda.get_per_process_memory_fraction(index) != fraction:
        torch.cuda.set_per_process_memory_fraction(fraction, index)
