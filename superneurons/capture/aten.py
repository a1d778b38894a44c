"""Running an exported graph's ATen operations on the meta device, as capture does.

An exported graph names the example's device (arange, to) and its attention is one operation
whose kernel on the device differs from its meta twin's, in what it saves and in the layout of
its output; these say what capture does about it.
"""

import math

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from .graph import Saved

__all__ = ["DevicesOnMeta", "fused_attention", "storage_key", "with_traced_layout"]

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


def with_traced_layout(node, result):
    """``result`` with the strides export traced for ``node`` on the example's device, where
    its meta twin lays its outputs out otherwise: a fused attention's output is (batch, tokens,
    heads, dim) in memory on the device, so code that transposes it back and calls view()
    (nanoGPT) works there, and on meta only if the meta output is laid out the same. A view of
    the same storage: the bytes and aliasing capture measures stay the meta run's."""
    traced = node.meta.get("val")
    leaves, spec = pytree.tree_flatten(result)
    traced_leaves = pytree.tree_leaves(traced)
    if traced is None or len(leaves) != len(traced_leaves):
        return result

    def relaid(tensor, like):
        if not (isinstance(tensor, torch.Tensor) and isinstance(like, torch.Tensor)
                and tensor.shape == like.shape and tensor.stride() != like.stride()
                and _dense(like) and _dense(tensor)):
            return tensor
        with torch.enable_grad():                  # a view that keeps the output's autograd
            return tensor.as_strided(like.shape, like.stride(), tensor.storage_offset())
    relaid_leaves = [relaid(t, like) for t, like in zip(leaves, traced_leaves)]
    if all(new is old for new, old in zip(relaid_leaves, leaves)):
        return result                                   # most layers: laid out alike already
    return pytree.tree_unflatten(relaid_leaves, spec)


def _dense(tensor: torch.Tensor) -> bool:
    """Whether its elements fill a block of memory once each (a permutation of a contiguous
    layout), so that any storage of its numel holds it and no two elements share an address."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(tensor.shape, tensor.stride())
                               if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True
