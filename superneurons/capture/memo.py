"""Capture's memo (trace.py Rule 4): a layer whose configuration and inputs look like an earlier
layer's behaves like it on the meta device, so it is not run again.

A deep ResNet repeats the same few layers thousands of times, and a BatchNorm on meta tensors runs
a Python decomposition; the memo cuts a 3,115-layer ResNet's capture from 4.5 s to 1.0 s
(benchmarks/results/planner_costs.json).

The memo keys a call by what decides its behaviour: the function or method, or for a module from
torch.nn its class, mode, configuration (extra_repr) and state shapes; and every argument,
tensors by shape, strides, dtype, requires_grad and which input they are. A user's own
module is never memoized: its behaviour may hang on attributes its repr does not show.

What it keeps per call: which inputs were written in place, and for every output leaf and saved
tensor whether it is an input, a view of one, an output, a new storage (with its bytes) or a
constant; the layer's scratch bytes, and whether it draws random numbers.
"""

import torch
from torch.utils import _pytree as pytree

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format,
          torch.layout)


class Unkeyable(Exception):
    """An argument the memo cannot describe: run the layer."""


def memo_key(node, module, args, kwargs, inputs: dict):
    """A hashable description of the call, or None if it must run. ``inputs``: id(fresh input)
    -> its position among the layer's inputs."""
    if module is not None:
        if not type(module).__module__.startswith("torch.nn"):
            return None
        head = (type(module), module.training, module.extra_repr(),
                tuple((n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in
                      (*module.named_parameters(recurse=False),
                       *module.named_buffers(recurse=False)) if t is not None))
    else:
        head = (node.op, node.target)

    def describe(obj):
        if isinstance(obj, torch.Tensor):
            if id(obj) not in inputs:
                raise Unkeyable              # model state read with get_attr
            return ("tensor", inputs[id(obj)], tuple(obj.shape), obj.stride(), obj.dtype,
                    obj.requires_grad, obj.storage_offset())
        if isinstance(obj, _PLAIN):
            return (type(obj), obj)
        if isinstance(obj, (tuple, list)):
            return (type(obj), tuple(describe(o) for o in obj))
        if isinstance(obj, dict):
            return (dict, tuple((k, describe(v)) for k, v in obj.items()))
        if isinstance(obj, slice):
            return (slice, describe(obj.start), describe(obj.stop), describe(obj.step))
        raise Unkeyable
    try:
        return head, describe(args), describe(kwargs)
    except Unkeyable:
        return None


def _spec(tensor: torch.Tensor) -> tuple:
    return (tuple(tensor.shape), tensor.stride(), tensor.storage_offset(), tensor.dtype,
            tensor.requires_grad, tensor.untyped_storage().nbytes())


class Pattern:
    """How one call behaved, in terms of its inputs' positions (``fresh``: the layer's fresh
    input tensors in order of first use)."""

    def __init__(self, result, fresh: list, mutated: list, saved: list, scratch: tuple,
                 random: bool):
        position = {id(t): k for k, t in enumerate(fresh)}
        leaves, self.spec = pytree.tree_flatten(result)
        self.leaves = []                   # (kind, constant or input position, tensor spec)
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                self.leaves.append(("constant", leaf, None))
            elif id(leaf) in position:
                self.leaves.append(("input", position[id(leaf)], None))
            elif leaf._base is not None and id(leaf._base) in position:
                self.leaves.append(("view", position[id(leaf._base)], _spec(leaf)))
            else:
                self.leaves.append(("new", None, _spec(leaf)))
        self.mutated = tuple(mutated)      # input positions written in place
        self.saved = tuple(saved)          # ("output", j) / ("input", k) / ("internal", nbytes)
        self.scratch = scratch             # (forward, backward) scratch bytes (scratch.py)
        self.random = random               # it draws random numbers

    def result(self, fresh: list):
        """Meta tensors like the original outputs: inputs as themselves, views as views of them,
        new tensors over storages of the original size."""
        leaves = []
        with torch.enable_grad():
            for kind, what, spec in self.leaves:
                if kind == "constant":
                    leaves.append(what)
                    continue
                if kind == "input":
                    leaves.append(fresh[what])
                    continue
                shape, stride, offset, dtype, requires_grad, nbytes = spec
                if kind == "view":
                    leaves.append(fresh[what].as_strided(shape, stride, offset))
                    continue
                itemsize = torch.empty(0, dtype=dtype).element_size()
                base = torch.empty(nbytes // itemsize, dtype=dtype, device="meta")
                leaves.append(base.as_strided(shape, stride, offset).detach()
                              .requires_grad_(requires_grad))
        return pytree.tree_unflatten(leaves, self.spec)
