"""Casts to float32 kept as nodes where a graph is traced without the step's autocast.

Traced in float32 (the meta device has no autocast), HF's ``logits.float()`` returns the logits
themselves, and export records no cast: whether the model returns the logits or their float32
copy is lost (trace.py Rule 7). Under the step's autocast the logits are bf16 and the copy is a
tensor of its own. So while such a graph is exported, a cast to float32 of a float32 tensor is
traced as an op of this module's, which the graph keeps as a node; after export it becomes
aten.to.dtype again, which the analysis under autocast runs as the step will: a copy of a bf16
tensor, the tensor itself where it is still float32. The graph then has the users and outputs
the step's own trace has.

Rule 1: only Tensor.float() and Tensor.to(torch.float32) (by position or dtype=, nothing else
        asked) of a float32 tensor are kept; any other call runs as it is.
Rule 2: the kept op is gone before the analysis: the graph runs and is planned on aten.to.dtype.
"""

import torch
from torch import fx
from torch.overrides import TorchFunctionMode

__all__ = ["KeptCasts", "restore_casts"]


@torch.library.custom_op("superneurons::kept_float32_cast", mutates_args=())
def _kept(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32, copy=True)


@_kept.register_fake
def _(x):
    return torch.empty_like(x, dtype=torch.float32)


def _backward(ctx, grad):
    return grad.to(ctx.dtype)


def _setup(ctx, inputs, output):
    ctx.dtype = inputs[0].dtype


_kept.register_autograd(_backward, setup_context=_setup)
_KEPT = torch.ops.superneurons.kept_float32_cast.default


class KeptCasts(TorchFunctionMode):
    """Rule 1, for the duration of an export."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _a_float32_no_op(func, args, kwargs):
            return _kept(args[0])
        return func(*args, **kwargs)


def _a_float32_no_op(func, args, kwargs) -> bool:
    if not args or not isinstance(args[0], torch.Tensor) or args[0].dtype != torch.float32:
        return False
    if func is torch.Tensor.float:
        return len(args) == 1 and not kwargs
    if func is torch.Tensor.to:
        asked = list(args[1:]) + [kwargs[k] for k in kwargs if k == "dtype"]
        return len(asked) == 1 and asked[0] is torch.float32 and set(kwargs) <= {"dtype"}
    return False


def restore_casts(gm: fx.GraphModule) -> int:
    """Rule 2: every kept cast of ``gm`` as aten.to.dtype; how many there were."""
    kept = [node for node in gm.graph.nodes
            if node.op == "call_function" and node.target is _KEPT]
    for node in kept:
        node.target, node.args, node.kwargs = torch.ops.aten.to.dtype, \
            (node.args[0], torch.float32), {}
    if kept:
        gm.recompile()
    return len(kept)
