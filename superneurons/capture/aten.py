"""Running an exported graph's ATen operations on the meta device, as capture does.

An exported graph names the example's device (arange, to) and its attention is one operation
whose kernel on the device differs from its meta twin's; these say what capture does about it.
"""

import math

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from .graph import Saved

__all__ = ["DevicesOnMeta", "fused_attention", "storage_key"]

_META = torch.device("meta")


class DevicesOnMeta(TorchFunctionMode):
    """Every device an operation names becomes the meta device, inside grad-mode and autocast
    regions too: an exported graph names the example's device (arange, to) where capture runs
    on meta tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        args, kwargs = pytree.tree_map_only(torch.device, lambda _: _META, (args, kwargs or {}))
        if "device" in kwargs and kwargs["device"] is not None:
            kwargs["device"] = _META
        return func(*args, **kwargs)


def storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def fused_attention(args, kwargs, fresh: dict, outputs: tuple) -> tuple:
    """What attention saves on a device: its fused kernels (flash, memory-efficient, cuDNN, and
    the CPU's flash) keep the query, key, value, mask and output and a log-sum-exp per query
    row, and make no scratch the size of the attention matrix. On meta tensors attention takes
    the math path, which saves that matrix: planning by it would count bytes no step holds and
    miss that the key and value themselves are read again in backward."""
    value_of = {id(t): v for v, t in fresh.items()}
    operands = [*args[:4], kwargs.get("attn_mask")]
    saved = [Saved(value_of[id(t)]) for t in operands
             if isinstance(t, torch.Tensor) and id(t) in value_of]
    saved += [Saved(v) for v in outputs]
    query = args[0]
    saved.append(Saved(None, math.prod(query.shape[:-1]) * 4))   # the float32 log-sum-exp
    return tuple(dict.fromkeys(saved)), (0, 0)
