"""Capture's entry: the model's call (its arguments, as a user gives them) and which tracer
captures it (trace.py Rule 1), then the analysis of every layer on the meta device."""

import contextlib
import logging

import torch
from torch import nn

from .assigned import assigned_refusal, leaves_watched
from .export import export_graph, hooks_of, host_random_state
from .value_read import LABELS_HINT, children_of
from .graph import LayerGraph
from .refused import refuse_under_autocast
from .sliced_loss import slice_losses
from .trace import Analyzer, aliased_when_traced, meta_like, trace

__all__ = ["Arguments", "capture", "example_args", "flat_inputs"]


class Arguments(tuple):
    """The model's positional arguments as they are (integers included, never a shape)."""


def example_args(example_input) -> tuple:
    """The model's positional arguments from what a user passes as an example: a tensor, a shape
    tuple (a meta tensor of that shape) or a tuple of the model's arguments."""
    if isinstance(example_input, Arguments):
        return tuple(example_input)
    if isinstance(example_input, torch.Tensor):
        return (example_input,)
    if isinstance(example_input, (tuple, list)) and example_input and \
            all(isinstance(d, int) and not isinstance(d, bool) for d in example_input):
        if not all(d > 0 for d in example_input):
            raise ValueError(f"an input shape must be positive integers, got {tuple(example_input)}")
        return (torch.empty(tuple(example_input), device="meta"),)
    if isinstance(example_input, (tuple, list)):
        return tuple(example_input)
    raise ValueError("example_input must be a tensor (any device, meta included), a shape tuple "
                     "such as (32, 3, 224, 224), or a tuple of the model's positional arguments, "
                     f"not {type(example_input).__name__}")


def _fx_is_exact(model: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Rule 1: fx replays a forward exactly only where the project knows that forward: one
    tensor in, the model and its modules with children from the zoo or torch.nn's containers
    (fx runs the others, leaves, as they are; a model without children it traces through,
    where a custom autograd Function would lose its backward), each with its class's forward
    (fx traces the class's: accelerate's prepare() sets an autocast forward on the instance),
    no hooks."""
    if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor) or hooks_of(model):
        return False
    def ours(module: nn.Module) -> bool:
        kind = type(module)
        return "forward" not in module.__dict__ and (
            kind in _CONTAINERS or kind.__module__.startswith("superneurons.models"))
    return all(ours(module) or (module is not model and not module._modules)
               for module in model.modules())


_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)

log = logging.getLogger(__name__)     # INFO: what a long capture is doing, for a status line


def capture(model: nn.Module, example_input, autocast=None, kwargs=None, *,
            tracer: str = "auto", device=None, packed_positions: bool = False,
            slice_loss: bool = True) -> LayerGraph:
    """The layer graph of ``model`` called like ``model(*example_args(example_input),
    **kwargs)``; ``autocast``: (device type, dtype) of the torch.autocast the step will run
    under, or None. ``tracer``: "auto" (Rule 1), or "export" to export a model fx could trace
    (to compare the two). ``device``: where the step runs, when the model's state lives
    elsewhere (state="host"). ``packed_positions``: an HF call's position_ids pack sequences
    (hf.py Rule 1). ``slice_loss``: cross-entropy layers with their backward in slices
    (sliced_loss.py)."""
    args, kwargs = example_args(example_input), dict(kwargs or {})
    refuse_under_autocast(model, autocast)                                  # refused.py
    if tracer not in ("auto", "export"):
        raise ValueError(f"tracer must be 'auto' or 'export', not {tracer!r}")
    if tracer == "auto" and _fx_is_exact(model, args, kwargs):
        log.info("capturing %s with torch.fx", type(model).__name__)
        gm, in_spec, out_spec, flat = trace(model), None, None, list(args)
    else:
        log.info("capturing %s with torch.export", type(model).__name__)
        exported = export_graph(model, args, kwargs, device, packed_positions)
        again = _under_the_step_autocast(model, args, kwargs, autocast, device)
        if again is not None and _casts_it_cannot_tell(exported.graph_module):
            traced_on, under = again
            with under:
                exported = export_graph(model, args, kwargs, traced_on, packed_positions)
        gm, in_spec, out_spec = exported.graph_module, exported.in_spec, exported.out_spec
        flat = flat_inputs(in_spec, args, kwargs)
    if slice_loss:
        slice_losses(gm)
    # with each input's requires_grad: a frozen model's input may need a gradient
    meta = [meta_like(t) if isinstance(t, torch.Tensor) else t for t in flat]
    log.info("analyzing the graph's %d nodes on the meta device", len(gm.graph.nodes))
    written, drawn_before = [], host_random_state()
    try:
        with leaves_watched(model, written) if in_spec is None else contextlib.nullcontext():
            graph = Analyzer(gm, autocast, exported=in_spec is not None).run(meta)
    except ValueError as error:
        if "labels" not in kwargs:
            raise
        raise ValueError(f"{error}{LABELS_HINT}") from error   # value_read.py
    if written:
        raise assigned_refusal(model, written, children_of(model), leaf=True)
    if host_random_state() != drawn_before:       # only a leaf's forward runs here
        raise ValueError(
            f"a module of {type(model).__name__} draws random numbers from Python's random or "
            "numpy's np.random in its forward: superneurons runs that forward as one layer, "
            "and again at every replay of it, which would draw other numbers than the forward "
            "did. Draw them with torch (torch.rand, torch.randperm), whose draws superneurons "
            "replays exactly.")
    graph.in_spec, graph.out_spec = in_spec, out_spec
    graph.param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    graph.buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    return graph


def _under_the_step_autocast(model, args: tuple, kwargs: dict, autocast, device):
    """Where a trace under no autocast cannot tell a cast from what it cast, (the device to
    trace again on, the autocast to trace under) so that the trace's dtypes are the step's;
    None where the trace already ran under the step's autocast (a step's own call), or no
    autocast acts where the model lives. A plan (sn.plan) of a model on the autocast's device
    type is traced again under that autocast; one on the meta device, where no autocast acts,
    or on the CPU, under the CPU's autocast on fake CPU tensors: its lists put matrix products
    in the lower precision as CUDA's do, and the analysis runs the step's own lists
    (autocast.py). Only then: a dtype the model's code reads from a tensor and the export
    writes into the graph (torch.empty(..., dtype=x.dtype)) is the CPU's lists' there, which
    run layer_norm and softmax in the lower precision where CUDA's run them in float32; traced
    under no autocast, it is float32, at or above the step's."""
    if autocast is None or torch.is_autocast_enabled(autocast[0]):
        return None
    device_type, dtype = autocast
    called = (a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
    where = device or next((t.device for t in (*model.parameters(), *model.buffers(), *called)
                            if t.device.type != "meta"), None)
    if where is not None and where.type == device_type:
        return device, torch.autocast(device_type, dtype=dtype)
    if where is None or where.type == "cpu":
        return torch.device("cpu"), torch.autocast("cpu", dtype=dtype)
    return None                                      # trace.py Rule 7 plans both readings


_CASTS = (torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout)
_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default)


def _casts_it_cannot_tell(gm) -> bool:
    """Whether a cast returned its input when traced (a cast to float32 traced in float32) and
    the model's output or a cross-entropy reads it, directly or through a view: HF's causal
    LMs return their logits and cast a float32 copy for their loss, which the trace cannot
    tell from the logits (trace.py Rule 7) nor slice (sliced_loss.py Rule 5)."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _CASTS or \
                not aliased_when_traced(node):
            continue
        readers = [*node.users, *(user for reader in node.users if reader.target in _VIEWS
                                  for user in reader.users)]
        if any(reader.op == "output" or
               reader.target is torch.ops.aten.cross_entropy_loss.default
               for reader in readers):
            return True
    return False


def flat_inputs(in_spec, args: tuple, kwargs: dict) -> list:
    """The graph's inputs from a call's (args, kwargs), flattened as export's spec orders them;
    a ValueError where the call's structure differs (another argument, a missing keyword)."""
    from torch.fx._pytree import tree_flatten_spec
    try:
        return list(tree_flatten_spec((tuple(args), dict(kwargs)), in_spec))
    except Exception as error:  # noqa: BLE001 -- pytree raises several kinds
        raise ValueError(f"the call's arguments do not match the captured signature: {error}") \
            from error
