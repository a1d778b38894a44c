"""Capture: trace any nn.Module down to its leaf layers, then run it on the meta device.

Rule 1: a leaf layer is a module without children (Conv2d, BatchNorm2d, or a user's own small
        module); functions and tensor methods between leaves (add, cat, flatten) are layers too.
Rule 2: nothing real is allocated: every layer runs on meta tensors, so shapes, saved tensors
        and bytes come for free, on any machine, for networks of thousands of layers.
Rule 3: each layer is run in isolation on fresh inputs, so that what autograd saves, what aliases
        and what is written in place is attributed to that layer alone.
Rule 4: a layer that looks like one already run (memo.py) is not run again: its pattern of
        outputs, in-place writes and saved tensors is reused.
Rule 5: for a step under torch.autocast, layers run inside AutocastOnMeta (autocast.py), so
        their outputs and saved tensors have the dtypes and bytes autocast gives them.
Rule 6: each layer's forward and backward scratch, the temporaries l_f and l_b do not name, is
        measured in that run (scratch.py).
"""

import contextlib
import operator

import torch
from torch import fx, nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils import _pytree as pytree

from .autocast import AutocastOnMeta
from .graph import Layer, LayerGraph, Saved, Storage, Value
from .kinds import is_random, kind_of
from .memo import Pattern, memo_key
from .scratch import LiveBytes, backward_scratch, one_kernel_backward


class _LeafTracer(fx.Tracer):
    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return len(module._modules) == 0


def trace(model: nn.Module) -> fx.GraphModule:
    """Symbolically trace ``model``; a ValueError says what to do when Python control flow
    depends on tensor values."""
    tracer = _LeafTracer()
    try:
        graph = tracer.trace(model)
    except Exception as error:  # fx raises TraceError, TypeError, RuntimeError...
        raise ValueError(
            f"superneurons could not capture {type(model).__name__}: {error}. The model's forward "
            "must not branch on tensor values; move such code into a module without children "
            "(it then becomes one layer) or call superneurons on the part that traces.") from error
    return fx.GraphModule(tracer.root, graph, class_name=type(model).__name__)


def _meta_like(tensor: torch.Tensor) -> torch.Tensor:
    meta = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
    return meta.requires_grad_(tensor.requires_grad)


def _layer_name(node: fx.Node, seen: dict) -> str:
    base = node.target if node.op == "call_module" else node.name
    seen[base] = seen.get(base, 0) + 1
    return base if seen[base] == 1 else f"{base}#{seen[base]}"


def capture(model: nn.Module, example_input, autocast=None) -> LayerGraph:
    """The layer graph of ``model`` for inputs shaped like ``example_input``; ``autocast``:
    (device type, dtype) of the torch.autocast the step will run under, or None."""
    if isinstance(example_input, (tuple, list)):          # a shape (torch.Size is a tuple)
        if not all(isinstance(d, int) and d > 0 for d in example_input):
            raise ValueError(f"an input shape must be positive integers, got {tuple(example_input)}")
        example = torch.empty(tuple(example_input), device="meta")
    elif isinstance(example_input, torch.Tensor):
        example = _meta_like(example_input.detach())
    else:
        raise ValueError("example_input must be a tensor (any device, meta included) or a shape "
                         f"tuple such as (32, 3, 224, 224), not {type(example_input).__name__}")
    gm = trace(model)
    return _Analyzer(gm, autocast).run(example)


class _Analyzer:
    """Walks the traced graph once, running each layer on meta tensors (Rules 2 and 3)."""

    def __init__(self, gm: fx.GraphModule, autocast=None):
        self.gm = gm
        # (device type, dtype) or None: made here so that a bad one fails before any layer runs
        self.autocast = AutocastOnMeta(*autocast) if autocast else None
        self.values: list = []
        self.storages: list = []
        self.layers: list = []
        self.env: dict = {}          # fx node -> object with meta tensors in place of values
        self.value_of: dict = {}     # id(meta tensor in env) -> value index
        self.meta_state: dict = {}   # module -> {name: meta tensor} for functional calls
        self.meta_tensors: list = []  # keeps env tensors alive so their ids stay unique
        self.attr_ids: set = set()    # meta twins of tensors read with get_attr (model state)
        self.memo: dict = {}          # memo key -> Pattern (Rule 4)

    def _new_value(self, tensor, producer, storage, requires_grad) -> tuple:
        index = len(self.values)
        self.values.append(Value(index, producer, storage, tuple(tensor.shape), tensor.dtype,
                                 requires_grad))
        plain = tensor.detach()
        self.value_of[id(plain)] = index
        self.meta_tensors.append(plain)
        return plain, index

    def _new_storage(self, nbytes: int, creator) -> int:
        self.storages.append(Storage(len(self.storages), int(nbytes), creator))
        return len(self.storages) - 1

    def _state(self, module: nn.Module) -> dict:
        if module not in self.meta_state:
            own = dict(module.named_parameters(recurse=False)) | dict(module.named_buffers(recurse=False))
            self.meta_state[module] = {name: _meta_like(t) for name, t in own.items()
                                       if t is not None and t.device.type != "meta"}
        return self.meta_state[module]

    def run(self, example: torch.Tensor) -> LayerGraph:
        names, last_call_of_module, last_random = {}, {}, None
        order_deps, inputs, outputs = {}, [], ()
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                if inputs:
                    raise ValueError("superneurons handles models with one tensor input; wrap the "
                                     "others into the module or pass them as constants")
                storage = self._new_storage(example.untyped_storage().nbytes(), None)
                self.env[node], index = self._new_value(example, None, storage, example.requires_grad)
                inputs.append(index)
            elif node.op == "get_attr":
                attr = operator.attrgetter(node.target)(self.gm)
                self.env[node] = _meta_like(attr) if isinstance(attr, torch.Tensor) else attr
                self.attr_ids.add(id(self.env[node]))
            elif node.op == "output":
                outputs = tuple(self.value_of[id(t)] for t in
                                pytree.tree_leaves(fx.node.map_arg(node.args[0], self.env.get))
                                if isinstance(t, torch.Tensor))
            else:
                layer = self._run_layer(node, _layer_name(node, names))
                deps = set()
                if layer.random:
                    if last_random is not None:
                        deps.add(last_random)  # replay random numbers in program order
                    last_random = layer.index
                if layer.module is not None:
                    if layer.module in last_call_of_module:
                        deps.add(last_call_of_module[layer.module])  # shared module: in order
                    last_call_of_module[layer.module] = layer.index
                if deps:
                    order_deps[layer.index] = deps
        self._order_in_place_writes(order_deps)
        params = {id(p): p for p in self.gm.parameters()}
        buffers = {id(b): b for b in self.gm.buffers()}
        return LayerGraph(
            layers=self.layers, values=self.values, storages=self.storages,
            input_values=tuple(inputs), output_values=outputs,
            param_bytes=sum(p.numel() * p.element_size() for p in params.values()),
            buffer_bytes=sum(b.numel() * b.element_size() for b in buffers.values()),
            graph_module=self.gm, order_deps=order_deps)

    def _order_in_place_writes(self, order_deps: dict) -> None:
        """A layer writing a storage in place runs after every earlier reader of that storage."""
        readers: dict = {}
        for layer in self.layers:
            for storage in layer.mutates:
                before = {r for r in readers.get(storage, ()) if r != layer.index}
                if before:
                    order_deps.setdefault(layer.index, set()).update(before)
            for value in layer.inputs:
                readers.setdefault(self.values[value].storage, []).append(layer.index)

    def _run_layer(self, node: fx.Node, name: str) -> Layer:
        module = self.gm.get_submodule(node.target) if node.op == "call_module" else None
        kind = kind_of(node, module)
        index = len(self.layers)
        # Rule 3: fresh, independent inputs, so aliasing and in-place writes show as identity.
        fresh, input_values = {}, []

        def prepare(arg_node):
            obj = self.env[arg_node]
            if not isinstance(obj, torch.Tensor) or id(obj) not in self.value_of:
                return obj
            value = self.value_of[id(obj)]
            input_values.append(value)
            if value not in fresh:
                fresh[value] = obj.detach().requires_grad_(
                    self.values[value].requires_grad and obj.is_floating_point()).clone()
            return fresh[value]

        args = fx.node.map_arg(node.args, prepare)
        kwargs = fx.node.map_arg(node.kwargs, prepare)
        order = list(fresh)                       # input values in order of first use
        tensors = [fresh[v] for v in order]
        key = memo_key(node, module, args, kwargs, {id(t): k for k, t in enumerate(tensors)})
        pattern = self.memo.get(key) if key is not None else None
        if pattern is not None:                                               # Rule 4
            result = pattern.result(tensors)
            mutated = list(pattern.mutated)
            scratch = pattern.scratch
        else:
            result, packed, mutated, watch = self._run(node, module, name, args, kwargs, tensors)
        mutates = tuple(sorted({self.values[order[k]].storage for k in mutated}))
        outputs, self.env[node], output_ids = self._record_outputs(result, fresh, index)
        if pattern is not None:
            saved = tuple(Saved(outputs[at]) if source == "output" else
                          Saved(order[at]) if source == "input" else Saved(None, at)
                          for source, at in pattern.saved)
        else:
            saved = self._classify_saved(packed, fresh, output_ids, module)
            del packed     # else the saved tensors outlive their use in the backward measured
            forward_scratch = watch.peak - watch.live
            scratch = (forward_scratch, 0 if one_kernel_backward(node, module) else
                       backward_scratch(watch, result, tensors))
            if key is not None:
                self.memo[key] = Pattern(result, tensors, mutated, [
                    ("internal", entry.nbytes) if entry.value is None else
                    ("output", outputs.index(entry.value)) if entry.value in outputs else
                    ("input", order.index(entry.value)) for entry in saved], scratch)
        layer = Layer(index=index, name=name, kind=kind, node=node, inputs=tuple(input_values),
                      outputs=outputs, saved=saved, mutates=mutates,
                      random=is_random(node, module, kind), module=module,
                      forward_scratch=scratch[0], backward_scratch=scratch[1])
        self.layers.append(layer)
        return layer

    def _run(self, node, module, name: str, args, kwargs, tensors: list) -> tuple:
        """Run the layer on its fresh inputs: (result, saved tensors, input positions written,
        the LiveBytes that watched it)."""
        versions = [t._version for t in tensors]
        packed = []
        watch = LiveBytes()

        def pack(tensor):
            packed.append(tensor)
            return tensor

        try:
            with saved_tensors_hooks(pack, lambda t: t), torch.enable_grad(), watch, \
                    (self.autocast or contextlib.nullcontext()):
                result = self._call(node, module, args, kwargs)
        except Exception as error:
            raise ValueError(f"layer {name!r} ({node.format_node()}) failed on the meta device: "
                             f"{error}. superneurons needs every layer to accept meta tensors; "
                             "make it a module without children or file an issue with the model.") \
                from error
        mutated = [k for k, t in enumerate(tensors) if t._version != versions[k]]
        return result, packed, mutated, watch

    def _call(self, node, module, args, kwargs):
        if node.op == "call_module":
            state = self._state(module)
            if not state:
                return module(*args, **kwargs)
            # swap in meta twins of the module's own state (a leaf has no children), much
            # faster than torch.func.functional_call on networks of thousands of layers
            saved = {}
            for name, twin in state.items():
                table = module._parameters if name in module._parameters else module._buffers
                saved[name] = (table, table[name])
                table[name] = twin
            try:
                return module(*args, **kwargs)
            finally:
                for name, (table, original) in saved.items():
                    table[name] = original
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        self_obj, *rest = args
        return getattr(self_obj, node.target)(*rest, **kwargs)

    def _record_outputs(self, result, fresh: dict, index: int):
        by_identity = {id(t): v for v, t in fresh.items()}
        outputs, output_ids = [], {}

        def record(tensor):
            if not isinstance(tensor, torch.Tensor):
                return tensor
            if id(tensor) in by_identity:        # in place: a new value on the same storage
                storage = self.values[by_identity[id(tensor)]].storage
            elif tensor._base is not None and id(tensor._base) in by_identity:  # a view
                storage = self.values[by_identity[id(tensor._base)]].storage
            else:
                storage = self._new_storage(tensor.untyped_storage().nbytes(), index)
            plain, value = self._new_value(tensor, index, storage, tensor.requires_grad)
            outputs.append(value)
            output_ids[id(tensor)] = value
            return plain

        env_result = pytree.tree_map(record, result)
        return tuple(outputs), env_result, output_ids

    def _classify_saved(self, packed, fresh, outputs: dict, module) -> tuple:
        inputs = {id(t): v for v, t in fresh.items()}
        state = set(self.attr_ids)
        if module is not None:
            state |= {id(t) for t in self._state(module).values()}
            state |= {id(t) for t in module.parameters(recurse=False)}
            state |= {id(t) for t in module.buffers(recurse=False)}
        if module is not None:
            state |= {id(t) for t in module.parameters(recurse=False)}
        saved, seen = [], set()
        for tensor in packed:
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            base = tensor._base if tensor._base is not None else tensor
            if id(tensor) in state or id(base) in state or isinstance(tensor, nn.Parameter):
                continue                          # model state is resident, not an activation
            value = outputs.get(id(tensor), outputs.get(id(base),
                                inputs.get(id(tensor), inputs.get(id(base)))))
            if value is not None:
                saved.append(Saved(value))
            else:
                saved.append(Saved(None, base.untyped_storage().nbytes()))
        return tuple(saved)
