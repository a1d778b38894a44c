"""A custom torch.autograd.Function, captured whole: one operation whose backward is the
Function's own.

torch.export records a Function's forward as the operations it runs and drops its backward, so
a step running that graph would differentiate those operations instead (HF's BLOOM trains its
GELU by a Function whose hand-written backward differs from autograd's in the last bits). While
the model is captured, a Function applied where it would be differentiated is called as
FUNCTION_OP instead (refused.py Rule 4), a custom operation export keeps as one node. Its forward
runs the Function's forward; its backward runs the forward again on the inputs it saved and
then the Function's own backward.

Rule 1: exact. The backward's forward is the forward's kernels on the same inputs, under the
        autocast state the forward ran in: its outputs and what it saves for the Function's
        backward are the forward's bits, so that backward computes plain PyTorch's gradients.
        A Function whose forward draws random numbers would draw others the second time: it
        is refused at capture (its forward is run there, on fake tensors, under a watch for
        operations tagged nondeterministic_seeded).
Rule 2: only what the operation's schema can carry: positional arguments whose tensors the
        pytree finds (others are constants of the call), and a tensor or a tuple or list of
        tensors returned. As autograd does for a Function, only a tensor that is an argument
        itself is differentiated, not one inside a list or dict. A Function that writes an
        input in place, or returns anything but tensors, is refused at capture (refused.py
        Rule 4; so is one called with keyword arguments). An output that is an input itself,
        or its view, is returned as a copy (an operation's outputs may not alias its inputs);
        its values are the same.
Rule 3: the forward runs under no_grad: a Function's forward computes the same whether or not
        autograd records it; it sees needs_input_grad all False (plain PyTorch's sees True
        where an input requires grad), which a forward that branches on it would notice.
Rule 4: a call is named by an index into this process's table of Functions and the constants
        of their calls (the operation's one integer argument); a graph holds it for the
        process's life.
"""

import dataclasses

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["FUNCTION_OP", "as_operation", "run_forward"]


@dataclasses.dataclass
class _Call:
    function: type              # the torch.autograd.Function subclass
    spec: pytree.TreeSpec       # of its positional arguments
    constants: list             # the arguments' leaves, None where a tensor goes
    single: bool | None = None  # whether its forward returns one tensor (None: not yet run)
    refusal: str | None = None  # why its forward cannot be captured (Rules 1 and 2)


_CALLS: list = []


def as_operation(function: type, args: tuple) -> tuple:
    """``function.apply(*args)`` while the model is captured, as FUNCTION_OP: (its output, None),
    or (anything, why it cannot be captured) where its forward showed so (Rules 1 and 2)."""
    leaves, spec = pytree.tree_flatten(args)
    # Rule 2: a tensor inside an argument carries no gradient through the Function
    tensors = [t for arg in args for t in ([arg] if isinstance(arg, torch.Tensor) else [
        leaf.detach() for leaf in pytree.tree_leaves(arg) if isinstance(leaf, torch.Tensor)])]
    constants = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    key = next((i for i, call in enumerate(_CALLS) if call.function is function
                and call.spec == spec and _same(call.constants, constants)), None)
    if key is None:
        key = len(_CALLS)
        _CALLS.append(_Call(function, spec, constants))
    out = FUNCTION_OP(key, tensors)
    call = _CALLS[key]
    if call.refusal is not None:
        return out, call.refusal
    return (out[0] if call.single else tuple(out)), None


def _same(a: list, b: list) -> bool:
    """The same constants: each the same object, or of one type and equal (an object whose
    comparison raises, or gives no truth value, counts as another)."""
    def equal(x, y) -> bool:
        try:
            return type(x) is type(y) and bool(x == y)
        except Exception:                                  # noqa: BLE001 -- any __eq__
            return False
    return len(a) == len(b) and all(x is y or equal(x, y) for x, y in zip(a, b))


def _arguments(call: _Call, tensors: list) -> list:
    feed = iter(tensors)
    leaves = [next(feed) if c is None else c for c in call.constants]
    return pytree.tree_unflatten(leaves, call.spec)


class _RandomWatch(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.random = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.random = True
        return func(*args, **(kwargs or {}))


def run_forward(key: int, tensors: list) -> list:
    """The Function's forward on ``tensors`` (Rule 3), its outputs as a list of new tensors
    (Rule 2)."""
    call = _CALLS[key]
    with torch.no_grad():
        out = call.function.apply(*_arguments(call, tensors))
    single = isinstance(out, torch.Tensor)
    outputs = [out] if single else list(out) if isinstance(out, (tuple, list)) else [out]
    if not all(isinstance(o, torch.Tensor) for o in outputs):
        call.refusal = (f"applies the custom autograd Function {_name(call)}, which returns "
                        "something other than tensors")
        return [t for t in outputs if isinstance(t, torch.Tensor)]
    call.single = single
    storages = {t.untyped_storage()._cdata for t in tensors}
    return [o.clone() if o.untyped_storage()._cdata in storages else o for o in outputs]


def _name(call: _Call) -> str:
    return f"{call.function.__module__}.{call.function.__qualname__}"


def _captured_forward(key: int, tensors: list) -> list:
    """On fake tensors while capture runs, and on the meta device while layers are traced:
    the forward, watched for random numbers (Rule 1)."""
    watch, versions = _RandomWatch(), [t._version for t in tensors]
    with watch:
        outputs = run_forward(key, tensors)
    call = _CALLS[key]
    if call.refusal is None and watch.random:
        call.refusal = (f"applies the custom autograd Function {_name(call)}, whose forward "
                        "draws random numbers; its own backward would need them drawn again")
    if call.refusal is None and versions != [t._version for t in tensors]:
        call.refusal = (f"applies the custom autograd Function {_name(call)}, which writes its "
                        "inputs in place")
    return outputs


@torch.library.custom_op("superneurons::autograd_function", mutates_args=())
def FUNCTION_OP(key: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return run_forward(key, tensors)


FUNCTION_OP.register_fake(_captured_forward)


def _setup_context(ctx, inputs, output) -> None:
    key, tensors = inputs
    ctx.key = key
    ctx.needs = [t.requires_grad for t in tensors]
    ctx.autocast = {device: (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                    for device in {t.device.type for t in tensors}
                    if torch.amp.is_autocast_available(device)}
    ctx.save_for_backward(*tensors)


def _backward(ctx, grads):
    """Rule 1: the forward again, then the Function's own backward through it."""
    call = _CALLS[ctx.key]
    inputs = [t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, ctx.needs)]
    with torch.enable_grad(), _autocast(ctx.autocast):
        out = call.function.apply(*_arguments(call, inputs))
    outputs = [out] if isinstance(out, torch.Tensor) else list(out)
    pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
    wanted = [t for t in inputs if t.requires_grad]
    found = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                     allow_unused=True) if pairs and wanted else ())
    return None, [next(found, None) if t.requires_grad else None for t in inputs]


class _autocast:
    """The autocast state of each device type the forward's inputs were on."""

    def __init__(self, states: dict):
        self.regions = [torch.autocast(device, dtype=dtype, enabled=enabled)
                        for device, (enabled, dtype) in states.items()]

    def __enter__(self):
        for region in self.regions:
            region.__enter__()

    def __exit__(self, *exc):
        for region in reversed(self.regions):
            region.__exit__(*exc)


FUNCTION_OP.register_autograd(_backward, setup_context=_setup_context)
