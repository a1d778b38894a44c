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

Holds nest, each under its own key: a forward's (a recomputation can run a wrapped forward
inside a backward), a backward's (its graph task), other wrappers' on the same device. The
strictest fraction applies; the caller's comes back with the last hold. A backward that raises
runs no callback: its hold is dropped when a forward starts outside any backward, or when its
wrapper is collected, and a convolution's workspace limit it left (workspaces.py) then gives
back the fraction of the holds that remain.
"""

import itertools
import weakref

import torch
from torch.utils import _pytree as pytree

from .room import reads_device_memory

# per CUDA device index: (the caller's fraction, {hold key: the holder's fraction}); a key is
# ("forward", a number of its own) or ("backward", the graph task's id, the cap's id)
_held: dict = {}
_numbers = itertools.count()


def available() -> bool:
    """Whether this torch can say what the caller's own limit was, to give it back, and which
    backward runs (to key its hold)."""
    return hasattr(torch.cuda, "get_per_process_memory_fraction") and \
        hasattr(torch._C, "_current_graph_task_id")


def capped(caps: dict, device: torch.device, budget_bytes: int, forward):
    """``forward()`` and the backward of what it returns under ``budget_bytes`` on ``device``
    (module Rule 8); ``caps``: the wrapper's AllocatorCap per device, made here once."""
    if not reads_device_memory(device):
        raise ValueError(f"strict_budget limits CUDA's caching allocator; this step runs "
                         f"on {device}: leave strict_budget off there")
    if deterministic_kernels():
        raise ValueError(
            "strict_budget limits cuDNN's convolution workspaces to the budget, and with "
            "deterministic kernels on, an engine chosen within less memory may round "
            "differently from the one plain PyTorch chooses: leave strict_budget off (a "
            "workspace past the budget is then warned about) or turn deterministic kernels off")
    cap = caps.get(device)
    if cap is None:
        cap = caps[device] = AllocatorCap(device, budget_bytes)
    key = cap.hold_forward()
    try:
        out = forward()
    finally:
        cap.release(key)
    cap.through_backward(out)
    return out


def deterministic_kernels() -> bool:
    """Whether the caller asked for reproducible kernels (cuDNN's deterministic flag, or
    torch.use_deterministic_algorithms): then training is promised plain PyTorch's bits."""
    return torch.backends.cudnn.deterministic or torch.are_deterministic_algorithms_enabled()


class AllocatorCap:
    """One wrapper's budget on one CUDA device, held while its steps run."""

    def __init__(self, device: torch.device, budget_bytes: int):
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.total = torch.cuda.get_device_properties(self.index).total_memory
        self.fraction = min(1.0, budget_bytes / self.total)
        self.keys: set = set()            # this cap's holds now
        weakref.finalize(self, _release_all, self.index, self.keys)

    def hold_forward(self):
        """Hold for a forward; returns the key to release."""
        if _graph_task() == -1:           # no backward runs here: a backward's hold is stale
            for key in [k for k in _held.get(self.index, (None, {}))[1] if k[0] == "backward"]:
                _release(self.index, key)
        key = ("forward", next(_numbers))
        self._hold(key)
        return key

    def release(self, key) -> None:
        self.keys.discard(key)
        _release(self.index, key)

    def through_backward(self, out) -> None:
        """Hold again from the first gradient that reaches ``out``'s tensors to the end of
        that backward. Leaves are skipped: a hook on one would stay for every later step."""
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.grad_fn is not None:
                tensor.register_hook(self._backward_begins)

    def _hold(self, key) -> None:
        caller, holders = _held.get(self.index, (None, {}))
        if caller is None:
            caller = torch.cuda.get_per_process_memory_fraction(self.index)
        holders[key] = self.fraction
        self.keys.add(key)
        _held[self.index] = (caller, holders)
        fraction = min([caller, *holders.values()])
        _apply(self.index, fraction)
        # the limit bounds what the allocator reserves anew; blocks it already holds free
        # beyond it (a step or an evaluation before this one) would still serve workspaces
        if _reserved_bytes(self.index) > fraction * self.total:
            torch.cuda.empty_cache()

    def _backward_begins(self, grad):
        key = ("backward", _graph_task(), id(self))
        if key not in _held.get(self.index, (None, {}))[1]:
            self._hold(key)
            # queued from a callback, the release runs after the callbacks the backward's own
            # hooks queue (the host-state tier's last gradient round: state.py)
            queue = torch.autograd.Variable._execution_engine.queue_callback
            queue(lambda: queue(lambda: self.release(key)))
        return None


def _graph_task() -> int:
    """The id of the backward running on this thread, -1 where none does."""
    return torch._C._current_graph_task_id()


def _release(index: int, key) -> None:
    caller, holders = _held.get(index, (None, {}))
    if holders.pop(key, None) is None:
        return
    _apply(index, min([caller, *holders.values()]))
    if not holders:
        del _held[index]


def _release_all(index: int, keys: set) -> None:
    for key in list(keys):
        _release(index, key)
    keys.clear()


def _reserved_bytes(index: int) -> int:
    # as calibration.allocated_bytes: without flattening every statistic in Python
    return torch.cuda.memory_stats_as_nested_dict(index)["reserved_bytes"]["all"]["current"]


def _apply(index: int, fraction: float) -> None:
    from .workspaces import rebase          # here: workspaces.py imports this module
    if torch.cuda.get_per_process_memory_fraction(index) != fraction:
        torch.cuda.set_per_process_memory_fraction(fraction, index)
    rebase(index, fraction)
