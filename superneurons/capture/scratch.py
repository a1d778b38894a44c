"""Scratch: the memory a layer needs only while it computes, which l_f and l_b do not name.

A layer made of several operations (PyTorch's LocalResponseNorm: mul, pad, avg_pool3d, mul, add,
pow, div) makes temporaries in its forward that it frees before it returns, and its backward
makes more on its way through the chain rule. l_f counts a layer's inputs, outputs and saved
tensors, l_b what the backward reads and the gradients it receives and writes; neither sees these
temporaries. For AlexNet's LRN at batch 1100 the backward's are 3.6 GiB over the 7.2 GiB l_b
named before (benchmarks/results/planner_costs_lrn.json): the largest layer, max(l_i), which a
step's peak cannot go below (BENCHMARKS.md, "AlexNet and its LRN").

Rule 1: a layer's scratch is measured, not modelled: its forward and then its backward run on the
        meta device under a dispatch mode that counts the bytes of every storage the operations
        make, until that storage is freed (storages keep their Python object, so a finalizer sees
        the moment).
Rule 2: forward scratch = the peak of those bytes in the forward, less what is still live when it
        returns (its outputs and saved tensors, which l_f counts). Backward scratch = the peak in
        the backward, less what was live when it began (outputs, saved tensors, the gradients it
        receives) and the input gradients it returns (l_b counts them). Saved tensors freed as
        autograd goes lower the peak, as they do on the GPU.
Rule 3: only input gradients are asked for: parameter gradients are resident, and a
        convolution's weight gradient works in cuDNN's workspace, which cuDNN fits into the
        memory left (DESIGN.md, deviations).
Rule 4: a layer whose backward cannot run on the meta device gets no backward scratch (the
        runtime's calibration then sees what it uses, as before).
Rule 5: torch.nn layers whose backward is one kernel writing the input gradient (convolution,
        linear, batch norm, ReLU, pooling, dropout; cat and add) are not run backward: they have
        no scratch to find, and their meta backward is a Python decomposition, run once per
        layer on a DenseNet-BC, whose layers all differ (the memo never hits).
Rule 6: a custom autograd Function captured whole (functions.py) is one operation to this mode,
        which would see its outputs alone: its forward is run under the mode, operation by
        operation, so that its temporaries are its scratch as a module's are. It counts as
        drawing random numbers: an operation inside it may draw untagged (a custom kernel).
"""

import operator
import weakref

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .functions import FUNCTION_OP, run_forward

__all__ = ["LiveBytes", "backward_scratch", "one_kernel_backward"]

_ONE_KERNEL_MODULES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear,
                       nn.ReLU, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d,
                       nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
                       nn.AdaptiveAvgPool3d, nn.Dropout, nn.Identity, nn.Flatten)
_ONE_KERNEL_FUNCTIONS = {torch.cat, torch.add, operator.add, operator.iadd, torch.flatten,
                         torch.relu, torch.nn.functional.relu, operator.getitem}
# the same for ATen operations (exported graphs), by overload packet; a view's backward is
# a view or one copy
_ONE_KERNEL_ATEN = {"conv1d", "conv2d", "conv3d", "convolution", "linear", "addmm", "mm", "bmm",
                    "batch_norm", "layer_norm", "relu", "relu_", "max_pool2d", "avg_pool2d",
                    "adaptive_avg_pool2d", "dropout", "add", "add_", "cat", "view", "reshape",
                    "flatten", "transpose", "permute", "t", "unsqueeze", "squeeze", "expand",
                    "split", "slice", "select", "contiguous", "embedding", "gelu", "silu",
                    "alias", "clone", "_to_copy", "to", "detach"}


def one_kernel_backward(node, module) -> bool:
    """Rule 5: a layer known to need no backward scratch."""
    if module is not None:
        return type(module) in _ONE_KERNEL_MODULES or (
            isinstance(module, nn.modules.batchnorm._BatchNorm)
            and type(module).__module__.startswith("torch.nn"))
    if node.op != "call_function":
        return False
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target.overloadpacket.__name__ in _ONE_KERNEL_ATEN
    return node.target in _ONE_KERNEL_FUNCTIONS


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of storages made by operations under it while they live (Rule 1), and
    notes whether any of them draws random numbers (a replay must draw the same) and which
    tensors they write in place (meta kernels may skip the write, so the version counter cannot
    tell)."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.random = False
        self.written: set = set()      # id() of tensors an operation wrote in place
        self._tracked = set()          # id() of live storages; a finalizer removes each

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is FUNCTION_OP._opoverload:                                    # Rule 6
            self.random = True             # whatever it draws, a replay draws again
            with self:
                return run_forward(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.random = True
        for argument, value in zip(func._schema.arguments, args):
            if argument.alias_info is not None and argument.alias_info.is_write:
                self.written.add(id(value))
        if func is torch.ops.aten.native_batch_norm.default and args[5]:
            # training updates its running statistics, which its schema does not declare
            self.written.update(id(t) for t in args[3:5] if t is not None)
        returns = func._schema.returns
        leaves = out if isinstance(out, (tuple, list)) else (out,)
        for position, tensor in enumerate(leaves):
            if not isinstance(tensor, torch.Tensor):
                continue
            if position < len(returns) and returns[position].alias_info is not None:
                continue                   # a view, or an input written in place: no new memory
            self._track(tensor.untyped_storage())
        self.peak = max(self.peak, self.live)
        return out

    def _track(self, storage) -> None:
        key = id(storage)
        if key in self._tracked:
            return
        nbytes = storage.nbytes()
        self._tracked.add(key)
        self.live += nbytes
        weakref.finalize(storage, self._free, key, nbytes)

    def _free(self, key: int, nbytes: int) -> None:
        self._tracked.discard(key)
        self.live -= nbytes

    def restart_peak(self) -> int:
        self.peak = self.live
        return self.live


def backward_scratch(watch: LiveBytes, result, inputs: list) -> int:
    """Run the backward of ``result`` (the forward having run under ``watch``) for the gradients
    of ``inputs`` that need one; its scratch per Rule 2, 0 where it cannot run (Rule 4)."""
    roots = [t for t in pytree.tree_leaves(result)
             if isinstance(t, torch.Tensor) and t.grad_fn is not None
             and (t.is_floating_point() or t.is_complex())]
    wanted = [t for t in inputs if t.requires_grad]
    if not roots or not wanted:
        return 0
    try:
        # the gradient a layer receives is made by the next layer's backward and freed once
        # used; a product with 2 gives it that life: only the engine holds it (counted below)
        proxies = [root * 2.0 for root in roots]
        ones = [torch.ones((), dtype=p.dtype, device=p.device).expand_as(p) for p in proxies]
        # as l_b counts them: once per storage of the outputs
        received = sum({id(r.untyped_storage()): r.untyped_storage().nbytes()
                        for r in roots}.values())
        with watch:
            at_start = watch.restart_peak()
            grads = torch.autograd.grad(proxies, wanted, ones, allow_unused=True)
        returned = {id(s): s.nbytes() for s in (g.untyped_storage() for g in grads
                                                 if g is not None)}
    except Exception:                      # noqa: BLE001 -- Rule 4: no meta backward for it
        return 0
    return max(0, watch.peak - at_start - received - sum(returned.values()))
