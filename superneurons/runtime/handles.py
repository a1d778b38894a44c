"""What autograd keeps in place of a saved tensor, and how it gets the tensor back.

The pack hook returns one of these; the unpack hook calls ``get``. When autograd is done with a
layer's backward it drops the handle, and ``__del__`` lets the pool or the segment free the bytes:
liveness in backward comes for free from autograd's own bookkeeping.
"""

import torch

from ..capture.sliced_loss import MODIFIED_INPLACE

# what torch.autograd.grad_mode._unsafe_preserve_version_counter calls on leaving, without a
# context manager per saved tensor (a step saves hundreds)
_set_version_counter = torch._C._autograd._unsafe_set_version_counter


def view_of(tensor: torch.Tensor):
    return tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset()


def rebuild(storage_bytes: torch.Tensor, view) -> torch.Tensor:
    """The saved view, over the bytes of its storage."""
    dtype, shape, stride, offset = view
    out = torch.empty(0, dtype=dtype, device=storage_bytes.device)
    return out.set_(storage_bytes.untyped_storage(), offset, shape, stride)


def storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over the whole storage behind ``tensor``."""
    out = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    storage = tensor.untyped_storage()
    return out.set_(storage, 0, (storage.nbytes(),), (1,))


class Written:
    """Whether a saved tensor has been written in place since it was saved. Autograd checks
    that at every unpack, except where saved_tensors_hooks are set, as the executor's are: the
    executor checks instead, through an alias that shares the tensor's version counter (as its
    views, its base and its detach() aliases do). Where the plan moves or drops the tensor, the
    alias lets go of its bytes (forget_bytes), so that the check keeps no memory alive that the
    plan frees; where the tensor is kept, the alias holds nothing the handle does not."""

    __slots__ = ("alias", "version")

    def __init__(self, tensor: torch.Tensor, keeps_bytes: bool = True):
        self.alias, self.version = tensor.detach(), tensor._version
        if not keeps_bytes:
            self.forget_bytes()

    def forget_bytes(self) -> None:
        """Keep the version counter, not the bytes; a write since the save stays counted."""
        alias = self.alias
        version = alias._version
        alias.set_()                                   # set_() counts as a write: undone
        _set_version_counter((alias,), (version,))

    def check(self) -> None:
        if self.alias._version != self.version:
            raise RuntimeError(
                f"{MODIFIED_INPLACE}: a tensor saved in a superneurons step is at version "
                f"{self.alias._version}; expected version {self.version} instead. It was "
                "written in place after the forward saved it (an optimizer step before "
                "backward, or a write to a returned output), as plain PyTorch would refuse too, "
                "unless the tensor is logits a superneurons-sliced cross-entropy keeps: wrap "
                "with slice_loss=False then.")


class StateWritten(Written):
    """The check of model state saved as it is (executor Rule 3): the tensor is its own alias,
    with no alias made at every save, and its bytes are the model's, never let go."""

    __slots__ = ()

    def __init__(self, tensor: torch.Tensor):
        self.alias, self.version = tensor, tensor._version

    def forget_bytes(self) -> None:
        """Nothing to let go: emptying the alias would empty the model's own tensor."""


class Holder:
    """What autograd keeps for a tensor saved outside a segment: the tensor itself until its
    layer has run, then what the plan made of it (a PoolRef, a ValueRef, or the tensor kept),
    with the saver's write check and the backward step that reads it (None for model state)."""

    __slots__ = ("handle", "written", "step")

    def __init__(self, handle, written: Written, step: int | None = None):
        self.handle, self.written, self.step = handle, written, step


class PoolRef:
    """A saved tensor living in the Unified Tensor Pool (may move to host and back)."""

    __slots__ = ("entry", "view", "step", "requires_grad")

    def __init__(self, entry, view, step: int, requires_grad: bool = False):
        self.entry, self.view, self.step, self.requires_grad = entry, view, step, requires_grad
        entry.refs += 1
        entry.need_steps.append(step)

    def get(self) -> torch.Tensor:
        entry = self.entry
        device = entry.pool.fetch(entry, self.step)
        # the tensor as saved, where it has not moved and this is its view (no new tensor)
        return device if self.view == entry.saved_view else rebuild(device, self.view)

    def __del__(self):
        entry = self.entry
        entry.refs -= 1
        if entry.refs == 0:
            entry.pool.release(entry)


class SlotRef:
    """A tensor saved inside a recomputation segment: dropped now, replayed in backward."""

    __slots__ = ("record", "key", "step", "written")

    def __init__(self, record, key, step: int | None = None, written: Written | None = None):
        # step: the backward that reads it (one saved inside a segment goes to autograd as is;
        # a ValueRef sits in a holder that carries the step and the Written)
        self.record, self.key, self.step, self.written = record, key, step, written
        record.hold(key)

    def get(self) -> torch.Tensor:
        return self.record.take(self.key)

    def __del__(self):
        self.record.drop(self.key)


class ValueRef(SlotRef):
    """A segment's value saved by a checkpoint layer after it (a conv reading a ReLU's output)."""

    __slots__ = ("view",)

    def __init__(self, record, value: int, view):
        super().__init__(record, ("value", value))
        self.view = view

    def get(self) -> torch.Tensor:
        value = self.record.take(self.key)
        if view_of(value) == self.view:
            return value
        return rebuild(storage_bytes(value), self.view)
