"""What autograd saves in a step, and how it comes back: the executor's pack and unpack hooks
(executor Rules 2, 3, 5, 6, 7 and 9). A part of the Executor, as room.py is: it reads the
executor's plan, pool, segment records and current layer; the executor runs the layers. Rule
numbers here are the executor's."""

import torch
from torch.utils import _pytree as pytree

from ..planner import Action, Policy
from .calibration import allocated_bytes
from .handles import Holder, PoolRef, SlotRef, StateWritten, ValueRef, Written, view_of
from .near_limit import bring_back_out_of_memory
from .state import StateRef
from .workspaces import FitOutOfMemory


class SavedTensors:
    """The executor's saved-tensor hooks: a saved tensor is kept, pooled, or replayed as the
    plan says (Rule 2), and comes back in backward, the pool making its step's room (Rule 6)."""

    def _pack(self, tensor: torch.Tensor):
        layer = self.layer
        if layer is None:
            return tensor
        key = (layer.index, self.counter)
        self.counter += 1
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in self.param_ptrs:
            return Holder(tensor, StateWritten(tensor))                # Rule 3 (and 7)
        if self.tier is not None and self.tier.reads(pointer):        # state.py Rule 2
            return self.tier.saved(pointer, view_of(tensor), self.bwd(layer.index))
        # a kernel's host-side scalars (attention's random seed and offset) stay as they are;
        # on CUDA told by is_cuda: reading a tensor's device makes an object, at every save
        elsewhere = not tensor.is_cuda if self.cuda else tensor.device.type != self.device.type
        if elsewhere:
            return tensor
        if self.segment is not None:
            return SlotRef(self.records[self.segment.index], key, self.bwd(layer.index),
                           Written(tensor, keeps_bytes=False))
        # as saved, before the layer writes any more; its bytes go once _resolve moves or drops it
        holder = Holder(tensor, Written(tensor))
        self.pending.append(holder)
        return holder

    def _unpack(self, handle):
        workspaces = self.workspaces
        if workspaces is None or not workspaces.limiting:
            return self._bring_back(handle)
        with workspaces.lifted():                                          # Rule 9
            return self._bring_back(handle)

    def _bring_back(self, handle):
        step = written = None
        if type(handle) is Holder:
            step, written, handle = handle.step, handle.written, handle.handle
        elif isinstance(handle, SlotRef):   # saved inside a segment: it carries its step
            step, written = handle.step, handle.written
        if written is not None:                                                # Rule 7
            written.check()
        if step is not None and (isinstance(handle, PoolRef) or step in self.scratch_steps):
            self._enter_backward_step(step)                                   # Rule 6
        if isinstance(handle, torch.Tensor):
            return handle
        if isinstance(handle, StateRef):
            return handle.get()
        try:
            return handle.get()
        except torch.OutOfMemoryError as error:  # Rule 5: evict all that may go, retry once
            self._after_out_of_memory(error, self.backward_step or 0, forward=False)
        try:
            return handle.get()
        except torch.OutOfMemoryError as error:
            raise RuntimeError(self._bring_back_failed(error)) from error
        finally:
            self.unfitted = False

    def _bring_back_failed(self, error: torch.OutOfMemoryError) -> str:
        """Rule 5's clear error, with what the plan counts at the step and the device held."""
        step = min(self.backward_step or 0, len(self.plan.steps) - 1)
        held = None
        if self.cuda and self.reads_allocator:
            held = allocated_bytes(self.device), torch.cuda.memory_reserved(self.device)
        return bring_back_out_of_memory(
            self.plan.policy, self.callers_budget_bytes, self.plan.steps[step].live_bytes,
            self.foreign_bytes if self.count_foreign else 0, held, error)

    def _after_out_of_memory(self, error: torch.OutOfMemoryError, step: int,
                             forward: bool) -> None:
        """Before Rule 5's retry at ``step``, all that may leave the device goes. An
        out-of-memory under a workspace limit (Rule 9) may be that limit's: the retry runs
        without it, and the calibration stands; any other says the calibrated excess is short,
        and the next steps calibrate again (Rule 4)."""
        if isinstance(error, FitOutOfMemory):
            self.unfitted = True
        else:
            self.calibration.again()
        self.pool.make_room(step, forward=forward, limit=0)

    def _enter_backward_step(self, step: int) -> None:
        if step != self.backward_step:
            self.backward_step = step
            self.pool.unlock_all()
            self.pool.make_room(step, forward=False)
            self.pool.prefetch_ahead(step)
            self._account(step)

    def _resolve(self, layer, position: int, inputs: list, out) -> None:
        outputs = [out] if isinstance(out, torch.Tensor) else \
            [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        by_storage = {}
        for tensor, value in (*zip(inputs, layer.inputs), *zip(outputs, layer.outputs)):
            by_storage[tensor.untyped_storage().data_ptr()] = value
        step = self.bwd(layer.index)
        actions, policy = self.plan.actions, self.plan.policy
        storage_of = self.storage_of_value
        for index, holder in enumerate(self.pending):
            tensor, written = holder.handle, holder.written
            holder.step = step
            value = by_storage.get(tensor.untyped_storage().data_ptr())
            if value is None:       # a layer's own tensor (pooling indices, batch statistics)
                if policy is Policy.SUPERNEURONS:
                    view = view_of(tensor)
                    entry = self.pool.add((self.step_id, layer.index, index), written.alias,
                                          position, view, written)
                    holder.handle = PoolRef(entry, view, step)
                continue
            storage = storage_of[value]
            action = actions[storage]
            if action is Action.OFFLOAD:
                holder.handle = self._pool_ref(storage, tensor, step, written=written)
            elif action is Action.RECOMPUTE:
                record = self.records[self.segment_of[self.graph.values[value].producer].index]
                holder.handle = ValueRef(record, value, view_of(tensor))
                written.forget_bytes()
        self.pending = []

    def _pool_ref(self, storage: int, tensor: torch.Tensor, step: int,
                  requires_grad: bool = False, written: Written | None = None) -> PoolRef:
        """A handle on the pool's one entry for a planned storage (made at its first saver);
        ``written``: the saver's check, whose alias of the tensor the entry may keep."""
        view = view_of(tensor)
        # an alias without autograd's history: the entry must not keep the graph alive
        alias = tensor.detach() if written is None else written.alias
        entry = self.pool.add((self.step_id, storage), alias, self.last_forward_use[storage],
                              view, written)
        return PoolRef(entry, view, step, requires_grad)
