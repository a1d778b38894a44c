"""Capture by torch.export: the model's own forward, any interface, as a graph of ATen operations.

torch.export (non-strict, its training IR) runs the user's Python once on fake tensors and records
every operation it reaches: control flow on sizes is specialized to the example, grad-mode and
autocast regions become one node each (wrap_with_set_grad_enabled, wrap_with_autocast), dropout
and every other random draw appear as operations, and positional and keyword arguments and the
output's structure (tuples, dicts, HF output objects) travel as pytree specs. Each node keeps the
module it came from (nn_module_stack), which names the layers.

Rule 1: the graph reads parameters and buffers with get_attr on the user's own tensors (the same
        objects, so the optimizer's updates and load_state_dict reach the next step), never copies.
Rule 3: with the model's state in host memory and the step on a device (state="host"), export
        sees the state as if on that device (fake tensors), so the graph is the device's.
Rule 2: what export cannot represent exactly is refused before a step runs: module hooks (export
        inlines them once, so a hook's Python would not run per step), data-dependent control
        flow, custom objects, graphs that return mutated inputs, draws from Python's or numpy's
        global generators (the graph would reuse capture's numbers), tensor attributes the
        forward assigns (export_said.py Rule 2) and other attributes it changes (assigned.py).
"""

import builtins
import contextlib
import random
import re
import threading
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from .assigned import assigned_refusal, watched_attributes
from .export_said import said_by_export, stale_attributes
from .hf import exported_as_called
from .refused import (autograd_python_refusal, autograd_python_watched, functorch_transforms,
                      reentrant_checkpoints_refused, reentrant_refusal, refuse_unsupported)
from .value_read import children_of, is_value_read, value_read_refusal

__all__ = ["ExportedGraph", "export_graph", "hooks_of", "module_path"]

# the watches around export patch torch for the process (refused.py Rule 4, assigned.py,
# export_said.py): one capture at a time, so that two threads' patches cannot interleave and
# leave one installed
_one_capture = threading.RLock()
# checks export adds for the example's dtypes and devices: a plan's key already pins both
_DROPPED = {torch.ops.aten._assert_tensor_metadata.default}


@dataclass
class ExportedGraph:
    graph_module: fx.GraphModule
    in_spec: pytree.TreeSpec       # how (args, kwargs) flatten into the graph's placeholders
    out_spec: pytree.TreeSpec      # how the graph's outputs rebuild the model's output


# transformers installs these at a model's first call that asks for recorded outputs (router
# logits, attentions, hidden states) and keeps them: they only hand a module's output to the
# model's own return value, which export traces as the graph's outputs
_RECORDING_HOOKS = "transformers.utils.output_capturing"


def hooks_of(model: nn.Module) -> list:
    """Descriptions of the module hooks a captured graph could not run every step."""
    found = []
    kinds = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    for name, module in model.named_modules():
        for kind in kinds:
            hooks = getattr(module, kind, None) or {}
            if any(getattr(getattr(hook, "func", hook), "__module__", None) != _RECORDING_HOOKS
                   for hook in hooks.values()):
                found.append(f"{kind[1:-1].replace('_', ' ')} on {name or type(model).__name__}")
    module_hooks = nn.modules.module
    for kind in ("_global_forward_hooks", "_global_forward_pre_hooks",
                 "_global_backward_hooks", "_global_backward_pre_hooks"):
        if getattr(module_hooks, kind, None):
            found.append(f"a global {kind[8:-1].replace('_', ' ')} (torch.nn.modules.module)")
    return found


def module_path(node: fx.Node) -> str:
    """The qualified name of the innermost module ``node`` ran in ('' for the model's own code)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    # export names a module called twice "name@2"; the module is the same
    return path.split("@")[0]


def _fake_like(tensors_on, example, mode=None):
    """Export's example: real tensors pass as they are; a meta tensor stands for the device the
    model lives on (a plan made for any device), as a fake tensor, so nothing is allocated. A
    tensor passed twice (labels=input_ids) is one fake tensor, as a real one is one tensor:
    export traces such a call otherwise than one of two tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = mode or FakeTensorMode(allow_non_fake_inputs=True)
    made = {}

    def fake(leaf):
        if not isinstance(leaf, torch.Tensor) or leaf.device.type != "meta" or \
                tensors_on.type == "meta":
            return leaf
        if id(leaf) not in made:
            with mode:
                out = torch.empty_strided(leaf.shape, leaf.stride(), dtype=leaf.dtype,
                                          device=tensors_on)
            made[id(leaf)] = out.requires_grad_(leaf.requires_grad)
        return made[id(leaf)]
    return pytree.tree_map(fake, example)


def export_graph(model: nn.Module, args: tuple, kwargs: dict, device=None,
                 packed_positions: bool = False) -> ExportedGraph:
    """Export ``model`` called with ``args`` and ``kwargs``; a ValueError says what to change.
    ``device``: where the step runs when the model's state lives elsewhere (state="host"): the
    model is exported as if its state were there (Rule 3). ``packed_positions``: an HF call's
    position_ids pack sequences (hf.py Rule 1)."""
    refuse_unsupported(model)             # before the hooks: HF's checkpointing adds one
    hooks = hooks_of(model)
    if hooks:
        raise ValueError(
            f"{type(model).__name__} has {', '.join(hooks[:3])}"
            f"{' and more' if len(hooks) > 3 else ''}: superneurons runs a graph captured once, "
            "so a hook's Python would not run every step. Remove the hook, or register it on "
            "the wrapped model (sn.wrap(...)) where it runs on every call. (torch.nn.utils."
            "weight_norm and spectral_norm work by hooks: use torch.nn.utils.parametrizations' "
            "instead.)")
    state = next(iter(model.parameters()), None)
    if device is None:
        device = state.device if state is not None else torch.device("cpu")
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    args, kwargs = _fake_like(device, (tuple(args), dict(kwargs)), mode)
    reentrant, assigned, autograd_python, written = [], [], [], []
    drawn_before = host_random_state()
    try:
        with _one_capture, _state_on(model, device, mode), \
                reentrant_checkpoints_refused(reentrant), \
                exported_as_called(model, args, kwargs, packed_positions), \
                said_by_export(assigned), autograd_python_watched(autograd_python), \
                watched_attributes(model, written):
            program = torch.export.export(model, args, kwargs, strict=False)
    except Exception as error:  # export raises many kinds: say what to do in one place
        if reentrant:
            raise reentrant_refusal(model) from error
        if autograd_python:     # seen before export failed: the cause the user can act on
            raise autograd_python_refusal(model, autograd_python) from error
        message = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:400]}"
        # torch 2.11's export fails on a generator argument; later ones lift it (Rule 1)
        generators = _held_generators(model) if "Generator" in str(error) else []
        if generators:
            raise ValueError(_generator_refusal(model, generators)) from error
        if is_value_read(error):
            raise value_read_refusal(model, error, message, kwargs) from error
        # newer torch names the output's class; torch 2.11 fails earlier, hashing the instance
        # (a built-in type unhashable there is the model's own error, not its output's class)
        unknown = re.search(r"Found <class '([^']+)'> in output, which is not a known type",
                            str(error)) or re.search(r"unhashable type: '(\w+)'", str(error))
        if unknown and "Cache" not in unknown.group(1) and \
                not hasattr(builtins, unknown.group(1)):
            raise ValueError(
                f"{type(model).__name__} returns a {unknown.group(1)}, which torch.export "
                "cannot take apart into tensors. Return a tuple, dict or namedtuple, or "
                "register the class before wrapping: torch.utils._pytree.register_dataclass("
                f"{unknown.group(1).rsplit('.', 1)[-1]}) for a dataclass.") from error
        if "Cache" in str(error) and "in output" in str(error):
            # transformers returns its key-value cache from a training call when the config
            # asks for one; with dropout, use_cache=False draws other masks than True does,
            # so superneurons cannot choose for the user without changing their gradients
            raise ValueError(
                f"{type(model).__name__} returns a key-value cache from this call ({message}), "
                "which superneurons cannot capture. A training step does not need it: call the "
                "model with use_cache=False, or set model.config.use_cache = False before "
                "training (an encoder-decoder such as T5 keeps copies of its config in its "
                "parts: pass use_cache=False in the call there). Plain PyTorch's gradients "
                "then are the ones superneurons reproduces.") from error
        if "more than 1 value per channel when training" in message:
            raise ValueError(
                f"calling {type(model).__name__} with these arguments fails: {message}. A "
                "batch norm in training mode needs more than one value per channel: train "
                "with a batch of 2 or more (or inputs large enough to leave more than one "
                "pixel there).") from error
        parts = children_of(model)
        raise ValueError(
            f"torch.export could not capture {type(model).__name__} called with these "
            f"arguments: {message.rstrip('.')}. If the model fails so when called plainly, "
            "check their number, shapes and dtypes; if it runs plainly, export cannot take its "
            "forward: " + (f"wrap a part of it in its place{parts}, and " if parts else "")
            + "file an issue with the model.") from error
    if functorch_transforms(program.graph_module):
        autograd_python.append("runs a functorch transform (torch.vmap, torch.func)")
    if autograd_python:
        raise autograd_python_refusal(model, autograd_python)
    if host_random_state() != drawn_before:
        raise ValueError(
            f"{type(model).__name__}'s forward draws random numbers from Python's random or "
            "numpy's np.random (or seeds them): superneurons runs the graph it captured, so its "
            "steps would reuse the numbers drawn at capture and leave those generators as they "
            "are, where plain PyTorch draws new ones at every call (HF's Wav2Vec2, HuBERT and "
            "WavLM mask their features so: SpecAugment). Draw them with torch (torch.rand, "
            "torch.randperm), whose draws superneurons replays exactly, or turn off the feature "
            "that draws them (for SpecAugment, config.apply_spec_augment = False).")
    assigned = stale_attributes(model, assigned)
    if assigned:
        raise ValueError(
            f"{type(model).__name__}'s forward assigns tensor attributes ("
            f"{', '.join(assigned[:4])}{' and more' if len(assigned) > 4 else ''}): "
            "superneurons runs the graph it captured, not the forward's Python, so after its "
            "steps they would hold what they held before the first call, where plain PyTorch "
            "sets them at every call. Return such a tensor from the forward instead (an "
            "auxiliary loss, a cache), or wrap the parts of the model that do not assign them"
            + children_of(model) + ".")
    if written:
        raise assigned_refusal(model, written, children_of(model))
    return _with_model_state(program, model)


def host_random_state() -> tuple:
    """The global generators a forward may draw from outside torch: Python's and numpy's (a
    generator object the model holds is not seen)."""
    try:
        import numpy
    except ImportError:
        return (random.getstate(),)
    kind, keys, position, has_gauss, gauss = numpy.random.get_state()
    return random.getstate(), (kind, keys.tobytes(), position, has_gauss, gauss)


def _held_generators(model: nn.Module) -> list:
    """Where the model's modules hold a torch.Generator (in lists and dicts too)."""
    return [f"{prefix}.{name}" if prefix else name
            for prefix, module in model.named_modules()
            for name, value in vars(module).items()
            if any(isinstance(v, torch.Generator) for v in pytree.tree_leaves(value))]


def _generator_refusal(model: nn.Module, generators: list) -> str:
    return (f"{type(model).__name__}'s forward draws from a torch.Generator it holds "
            f"({', '.join(generators[:4])}): superneurons runs the graph it captured, which "
            "cannot advance that generator, so its steps would not draw what plain PyTorch "
            "draws. Draw from torch's default generator (seeded by torch.manual_seed), whose "
            "draws superneurons replays exactly, or wrap the parts of the model that do not "
            "draw from it" + children_of(model) + ".")


def _held_object_refusal(model: nn.Module, spec) -> str:
    """Export lifts objects the model holds out of the graph (a custom object input): a
    torch.Generator the forward draws from is the one users meet."""
    generators = _held_generators(model)
    if generators:
        return _generator_refusal(model, generators)
    return (f"{type(model).__name__} holds a {spec.kind.name.lower()} ({spec.target}), an "
            "object torch.export lifts out of the graph, which superneurons cannot run at "
            "every step. Wrap the parts of the model that do not use it" + children_of(model)
            + ".")


@contextlib.contextmanager
def _state_on(model: nn.Module, device: torch.device, mode):
    """Rule 3: the model's parameters and buffers as fake tensors on ``device`` while export
    runs its Python, where they live elsewhere. Code that asks where a tensor is (HF's
    attention masks: materialized on the CPU, causal flags on CUDA) then takes the branch the
    step will run; exported as it sits on the host, Llama's step on CUDA differed from plain
    PyTorch's (benchmarks/results/state_tier_exact_export_on_host.json)."""
    state = {**dict(model.named_parameters(remove_duplicate=False)),
             **dict(model.named_buffers(remove_duplicate=False))}
    if all(t.device == device for t in state.values()):
        yield
        return
    from torch.nn.utils.stateless import _reparametrize_module
    fakes, made = {}, {}
    with mode:
        for name, tensor in state.items():
            if id(tensor) not in made:       # tied weights stay one tensor
                fake = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype,
                                           device=device)
                made[id(tensor)] = nn.Parameter(fake, tensor.requires_grad) \
                    if isinstance(tensor, nn.Parameter) else fake
            fakes[name] = made[id(tensor)]
    with _reparametrize_module(model, fakes, tie_weights=True):
        yield


def _with_model_state(program, model: nn.Module) -> ExportedGraph:
    """The exported graph with its lifted parameters, buffers and constants read by get_attr
    from the model itself (Rule 1), its user inputs left as placeholders."""
    signature = program.graph_signature
    for spec in signature.output_specs:
        if spec.kind is not OutputKind.USER_OUTPUT:
            raise ValueError(
                f"{type(model).__name__}'s forward writes into its {spec.kind.name.lower()} "
                f"{spec.target!r} in a way superneurons cannot replay; file an issue with the "
                "model")
    kinds = {spec.arg.name: spec for spec in signature.input_specs}
    root: dict = {}
    graph = fx.Graph()
    env: dict = {}
    for node in program.graph.nodes:
        if node.op == "placeholder":
            spec = kinds[node.name]
            if spec.kind is InputKind.USER_INPUT:
                env[node] = graph.placeholder(node.name)
            elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
                root[spec.target] = _model_state(model, spec.target, program)
                env[node] = graph.get_attr(spec.target)
            elif spec.kind is InputKind.CONSTANT_TENSOR:
                name = f"_constant_{len(root)}"
                root[name] = program.constants[spec.target]
                env[node] = graph.get_attr(name)
            else:
                raise ValueError(_held_object_refusal(model, spec))
        elif node.op == "get_attr":        # the body of a grad-mode or autocast region
            name = f"_region_{node.target}"
            root[name] = _without_checks(getattr(program.graph_module, node.target))
            env[node] = graph.get_attr(name)
        elif node.op == "output":
            graph.output(fx.node.map_arg(node.args[0], env.__getitem__))
        elif node.target in _DROPPED:
            continue
        else:
            env[node] = graph.node_copy(node, env.__getitem__)
    _read_state_written_in_place(graph)
    gm = fx.GraphModule(root, graph, class_name=type(model).__name__)
    call_spec = program.call_spec
    return ExportedGraph(gm, call_spec.in_spec, call_spec.out_spec)


def _read_state_written_in_place(graph: fx.Graph) -> None:
    """An in-place operation returns the tensor it wrote: where that is model state (a
    BatchNorm's step count, counted again by a second call of the module), later readers read
    the state itself, so capture sees state read and written, which replays copy."""
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or \
                not node.args or not isinstance(node.args[0], fx.Node):
            continue
        returns = target._schema.returns
        if node.args[0].op == "get_attr" and returns and returns[0].alias_info is not None \
                and returns[0].alias_info.is_write:
            node.replace_all_uses_with(node.args[0])


def _without_checks(region: fx.GraphModule) -> fx.GraphModule:
    """A region's body without export's dtype checks, which capture's meta run (where autocast
    casts nothing) would fail; nested regions too."""
    for node in list(region.graph.nodes):
        if node.op == "call_function" and node.target in _DROPPED and not node.users:
            region.graph.erase_node(node)
        elif node.op == "get_attr" and isinstance(getattr(region, node.target, None),
                                                  fx.GraphModule):
            _without_checks(getattr(region, node.target))
    region.recompile()
    return region


def _model_state(model: nn.Module, target: str, program) -> torch.Tensor:
    try:
        return model.get_parameter(target)
    except AttributeError:
        pass
    try:
        return model.get_buffer(target)
    except AttributeError:
        raise ValueError(f"torch.export names {target!r}, which {type(model).__name__} does not "
                         "hold as a parameter or buffer; file an issue with the model") from None
