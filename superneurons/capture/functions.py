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
        autocast state and from the random number generators' states the forward ran with
        (CPU's and those of the inputs' CUDA devices, as torch.utils.checkpoint keeps them; the
        generators are put back after): its outputs and what it saves for the Function's
        backward are the forward's bits, so that backward computes plain PyTorch's gradients.
        The operation counts as drawing random numbers (scratch.py Rule 6), so a replay of the
        forward (the executor's) draws the numbers the step drew. It keeps every input for
        that: a later in-place write into one is refused before the step (trace.py), where
        plain PyTorch fails only if the Function saved that input itself.
Rule 2: only what the operation's schema can carry: positional arguments whose tensors the
        pytree finds (others are constants of the call), and a tensor or a tuple or list of
        tensors returned. As autograd does for a Function, only a tensor that is an argument
        itself is differentiated, not one inside a list or dict. A Function that writes an
        input in place, takes a module (whose tensors the graph would not see) or returns
        anything but tensors is refused at capture (refused.py Rule 4; so is one called with
        keyword arguments). An output that is an input itself, another output, or a view of
        one is returned as a copy (an operation's outputs may not alias its inputs or each
        other); its values are the same.
Rule 3: as the Function's own outputs: those it marks non-differentiable (found at capture,
        on fake tensors) are the operation's too, and an output no later operation gave a
        gradient reaches its backward as None, which the Function sees as it would (zeros
        where it materializes them).
Rule 4: a parameter the Function takes reaches its backward as itself (a backward that writes
        its .grad or reads its attributes sees the parameter, as in plain PyTorch; it is held,
        not saved, so the Tensor Pool does not stand in for it); other inputs as tensors of
        their own, so that its backward stops at them. With state="host" a layer reads device
        copies of the parameters (runtime/state.py Rule 1), and so does the Function, each
        as a Parameter where capture saw one (_DeviceCopy): a flag of the parameter's is read
        from it; one that asks for another attribute the parameter has (Megatron's
        main_grad, a host tensor), or whose backward writes an input's .grad itself, not
        returning the gradient, is refused as it runs (the write would be lost).
Rule 5: a call is named by an index into this process's table of Functions and the constants
        of their calls (the operation's one integer argument), constants telling 0.0 from
        -0.0 and a NaN one constant; a graph holds it for the process's life.
"""

import contextlib
import dataclasses
import numbers
import threading

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree

__all__ = ["FUNCTION_OP", "as_operation", "run_forward", "calling", "function_called"]


@dataclasses.dataclass
class _Call:
    function: type              # the torch.autograd.Function subclass
    spec: pytree.TreeSpec       # of its positional arguments
    constants: list             # the arguments' leaves, _TENSOR where a tensor goes
    parameters: tuple           # positions among its tensors that held a Parameter (Rule 4)
    single: bool | None = None  # whether its forward returns one tensor (None: not yet run)
    refusal: str | None = None  # why it cannot be captured (Rule 2)
    non_differentiable: tuple | None = None   # output indices (Rule 3; None: not yet found)


_CALLS: list = []
_TENSOR = object()          # a tensor's place among a call's constants (None is a constant)
# per thread: the generators' states before the forward the operation ran last (Rule 1), and
# whether this module is calling a Function itself (refused.py lets such calls through)
_local = threading.local()


def calling() -> bool:
    """Whether this thread is inside this module's own call of a Function."""
    return getattr(_local, "calling", False)


@contextlib.contextmanager
def _calling():
    before, _local.calling = calling(), True
    try:
        yield
    finally:
        _local.calling = before


def as_operation(function: type, args: tuple) -> tuple:
    """``function.apply(*args)`` while the model is captured, as FUNCTION_OP: (its output, None),
    or (anything, why it cannot be captured) where its forward showed so (Rules 1 and 2)."""
    leaves, spec = pytree.tree_flatten(args)
    # Rule 2: a tensor inside an argument carries no gradient through the Function
    tensors = [t for arg in args for t in ([arg] if isinstance(arg, torch.Tensor) else [
        leaf.detach() for leaf in pytree.tree_leaves(arg) if isinstance(leaf, torch.Tensor)])]
    constants = [_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    parameters = tuple(i for i, t in enumerate(tensors) if isinstance(t, nn.Parameter))
    if any(isinstance(c, nn.Module) for c in constants):
        return None, (f"applies the custom autograd Function {function.__module__}."
                      f"{function.__qualname__} to a module, whose tensors the captured graph "
                      "would not see: pass the module's tensors to it instead")
    key = next((i for i, call in enumerate(_CALLS) if call.function is function
                and call.spec == spec and call.parameters == parameters
                and _same(call.constants, constants)), None)
    if key is None:
        key = len(_CALLS)
        _CALLS.append(_Call(function, spec, constants, parameters))
    out = FUNCTION_OP(key, tensors)
    call = _CALLS[key]
    if call.refusal is not None:
        return out, call.refusal
    return (out[0] if call.single else tuple(out)), None


def function_called(node) -> str | None:
    """The name of the Function a captured graph's node calls, or None where it calls none."""
    if node.target is not FUNCTION_OP._opoverload:
        return None
    return _name(_CALLS[node.args[0]])


class _DeviceCopy(nn.Parameter):
    """Rule 4: a parameter's device copy (state="host") as the Function is given it, a
    Parameter. An attribute of the model's parameter that the copy lacks is read from the
    parameter where it is a flag (Megatron's sequence_parallel); any other (its main_grad, a
    host tensor) raises a ValueError that says so, hasattr included. One the parameter lacks
    too is missing, as it is there (getattr's default)."""

    def __new__(cls, copy: torch.Tensor, requires_grad: bool):
        given = super().__new__(cls, copy.detach(), requires_grad)
        given._superneurons_host = getattr(copy, "superneurons_copy_of", None)  # state.py's
        return given

    def __getattr__(self, name: str):
        host = self.__dict__.get("_superneurons_host")
        if name.startswith("_") or host is None or not hasattr(host, name):
            raise AttributeError(name)        # torch's own probes (hasattr) stay as they are
        value = getattr(host, name)
        if isinstance(value, (bool, int, float, str, type(None))):
            return value
        raise ValueError(
            f"a custom autograd Function asked for the attribute {name!r} of a parameter; with "
            "state=\"host\" superneurons gives it the parameter's device copy, and the "
            f"parameter's {name} is a {type(value).__name__} in host memory: wrap with "
            "state=\"device\"")


def _as_parameters(call: _Call, tensors: list) -> list:
    """The tensors, a device copy in a place that held a Parameter at capture as one (Rule 4).
    Where the state is on the device a step gives the Parameter itself there, and capture a
    twin (meta or fake), which stays as it is."""
    if not call.parameters:
        return tensors
    given = list(tensors)
    for i in call.parameters:
        tensor = given[i]
        if not isinstance(tensor, (nn.Parameter, FakeTensor)) and not tensor.is_meta:
            given[i] = _DeviceCopy(tensor, tensor.requires_grad)
    return given


def _same(a: list, b: list) -> bool:
    """The same constants: each the same object, or of one type and equal (an object whose
    comparison raises, or gives no truth value, counts as another)."""
    def equal(x, y) -> bool:
        if type(x) is not type(y):
            return False
        if isinstance(x, numbers.Number) and not isinstance(x, numbers.Integral):
            return repr(x) == repr(y)     # -0.0 is not 0.0, a NaN is one, numpy's too (Rule 5)
        try:
            return bool(x == y)
        except Exception:                                  # noqa: BLE001 -- any __eq__
            return False
    return len(a) == len(b) and all(x is y or equal(x, y) for x, y in zip(a, b))


def _arguments(call: _Call, tensors: list) -> list:
    feed = iter(tensors)
    leaves = [next(feed) if c is _TENSOR else c for c in call.constants]
    return pytree.tree_unflatten(leaves, call.spec)


def run_forward(key: int, tensors: list, keep_random: bool = True) -> list:
    """The Function's forward on ``tensors``, its outputs as a list of new tensors (Rule 2);
    ``keep_random``: the generators' states before it are kept for the backward (Rule 1)."""
    call = _CALLS[key]
    if keep_random:
        _local.states = _random_states(tensors)
    with _calling(), torch.no_grad(), _traced(tensors):
        out = call.function.apply(*_arguments(call, _as_parameters(call, tensors)))
    single = isinstance(out, torch.Tensor)
    outputs = [out] if single else list(out) if isinstance(out, (tuple, list)) else [out]
    if not all(isinstance(o, torch.Tensor) for o in outputs):
        call.refusal = (f"applies the custom autograd Function {_name(call)}, which returns "
                        "something other than tensors")
        return [t for t in outputs if isinstance(t, torch.Tensor)]
    call.single = single
    seen, fresh = {t.untyped_storage()._cdata for t in tensors}, []
    for output in outputs:
        if output.untyped_storage()._cdata in seen:
            output = output.clone()
        seen.add(output.untyped_storage()._cdata)
        fresh.append(output)
    return fresh


def _traced(tensors: list):
    """Traced on the meta device, a tensor the Function makes (HF SEW-D's
    torch.tensor(finfo.min)) is made there too, beside its meta inputs; called, where it makes
    it."""
    return torch.device("meta") if any(t.is_meta for t in tensors) else contextlib.nullcontext()


def _random_states(tensors: list) -> tuple:
    devices = sorted({t.device.index if t.device.index is not None else
                      torch.cuda.current_device() for t in tensors if t.device.type == "cuda"})
    return torch.get_rng_state(), [(d, torch.cuda.get_rng_state(d)) for d in devices]


@contextlib.contextmanager
def _random_as(states):
    """Rule 1: the generators as the forward found them, put back after."""
    if states is None:
        yield
        return
    cpu, cuda = states
    with torch.random.fork_rng(devices=[d for d, _ in cuda]):
        torch.set_rng_state(cpu)
        for device, state in cuda:
            torch.cuda.set_rng_state(state, device)
        yield


def _name(call: _Call) -> str:
    return f"{call.function.__module__}.{call.function.__qualname__}"


def _captured_forward(key: int, tensors: list) -> list:
    """On fake tensors while capture runs: the forward, checked for inputs written in place
    (Rule 2), and which outputs the Function marks non-differentiable (Rule 3)."""
    versions = [t._version for t in tensors]
    outputs = run_forward(key, tensors, keep_random=False)
    call = _CALLS[key]
    if call.refusal is None and versions != [t._version for t in tensors]:
        call.refusal = (f"applies the custom autograd Function {_name(call)}, which writes its "
                        "inputs in place")
    if call.refusal is None and call.non_differentiable is None:
        # a Function's outputs require grad where any input does, but those it marks
        probe = [t.detach().requires_grad_(t.is_floating_point() or t.is_complex())
                 for t in tensors]
        with _calling(), torch.enable_grad():
            out = call.function.apply(*_arguments(call, probe))
        call.non_differentiable = tuple(
            index for index, o in enumerate([out] if call.single else out)
            if (o.is_floating_point() or o.is_complex()) and not o.requires_grad)
    return outputs


@torch.library.custom_op("superneurons::autograd_function", mutates_args=())
def FUNCTION_OP(key: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return run_forward(key, tensors)


FUNCTION_OP.register_fake(_captured_forward)


def _setup_context(ctx, inputs, output) -> None:
    key, tensors = inputs
    ctx.key, ctx.random = key, getattr(_local, "states", None)
    _local.states = None
    ctx.needs = [t.requires_grad for t in tensors]
    ctx.autocast = {device: (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                    for device in {t.device.type for t in tensors}
                    if torch.amp.is_autocast_available(device)}
    ctx.set_materialize_grads(False)                                            # Rule 3
    ctx.mark_non_differentiable(*[output[i] for i in _CALLS[key].non_differentiable or ()])
    # Rule 4: a parameter as itself (saved tensors come back as tensors of their own)
    ctx.parameters = {i: t for i, t in enumerate(tensors) if isinstance(t, nn.Parameter)}
    ctx.save_for_backward(*[None if i in ctx.parameters else t for i, t in enumerate(tensors)])


def _backward(ctx, grads):
    """Rule 1: the forward again, then the Function's own backward through it."""
    call = _CALLS[ctx.key]
    saved = [ctx.parameters.get(i, t) for i, t in enumerate(ctx.saved_tensors)]
    inputs = _as_parameters(call, [t if i in ctx.parameters else                 # Rule 4
                                   t.detach().requires_grad_(need)
                                   for i, (t, need) in enumerate(zip(saved, ctx.needs))])
    with contextlib.ExitStack() as regions:
        for region in (_calling(), _random_as(ctx.random), torch.enable_grad(), _traced(inputs),
                       *[torch.autocast(device, dtype=dtype, enabled=enabled)
                         for device, (enabled, dtype) in ctx.autocast.items()]):
            regions.enter_context(region)
        out = call.function.apply(*_arguments(call, inputs))
    outputs = [out] if isinstance(out, torch.Tensor) else list(out)
    pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
    wanted = [t for t in inputs if t.requires_grad]
    found = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                     allow_unused=True) if pairs and wanted else ())
    grads = [next(found, None) if t.requires_grad else None for t in inputs]
    written = [i for i, t in enumerate(inputs) if i not in ctx.parameters and t.grad is not None]
    if written:                                                                 # Rule 4
        copy = isinstance(inputs[written[0]], _DeviceCopy)
        raise ValueError(
            f"the backward of the custom autograd Function {_name(call)} "
            f"sets .grad of its input {written[0]} itself, which superneurons passes as "
            + ("the parameter's device copy (state=\"host\")" if copy else
               "a tensor of its own") + ": the write would be lost. Return the gradient from "
            "backward instead" + (", or wrap with state=\"device\"." if copy else "."))
    return None, grads


FUNCTION_OP.register_autograd(_backward, setup_context=_setup_context)
