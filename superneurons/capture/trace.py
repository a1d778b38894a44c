"""Capture: any nn.Module as a graph of layers, then each layer run on the meta device.

Rule 1 (entry.py applies it): a model whose forward code the project wrote (the zoo, torch.nn
        containers; not a model without children, whose forward is its own code) is traced
        by torch.fx down to its leaf modules, which run as layers;
        functions and tensor methods between leaves (add, cat, flatten) are layers too. Any
        other model is captured by torch.export (export.py), whose ATen operations are the
        layers: fx drops grad-mode and autocast regions and cannot follow control flow, export
        keeps them.
Rule 2: nothing real is allocated: every layer runs on meta tensors, so shapes, saved tensors
        and bytes come for free, on any machine, for networks of thousands of layers.
Rule 3: each layer is run in isolation on fresh inputs, so that what autograd saves, what aliases
        and what is written in place is attributed to that layer alone. A fresh input keeps
        its tensor's strides: an operation that copies only a tensor it cannot view
        (contiguous, reshape) must copy in capture where it copies in the step, or its copy is
        planned as a view of its input (the contiguous halves of a split's logits, one storage
        with them: a replay then reads the wrong half).
Rule 4: a layer that looks like one already run (memo.py) is not run again: its pattern of
        outputs, in-place writes and saved tensors is reused.
Rule 5: for a step under torch.autocast, layers run inside AutocastOnMeta (autocast.py), so
        their outputs and saved tensors have the dtypes and bytes autocast gives them.
Rule 6: each layer's forward and backward scratch, the temporaries l_f and l_b do not name, is
        measured in that run (scratch.py), and so is whether it draws random numbers (any
        operation tagged nondeterministic_seeded): a replay must draw the same ones.
Rule 7: an output made by an operation that returned its input, or a view of it, when the
        graph was traced (a cast to the dtype the input had then: HF's ``logits.float()``
        traced in float32) but a tensor of its own here (under autocast the input is
        bfloat16) may be either tensor in the step: the trace cannot tell which one the
        model returns. Where the graph reads the cast besides returning it, both are outputs,
        kept to the end of the step (a gradient from outside counted once, for the larger:
        planner/gradients.py Rule 5). HF's causal LMs return the bfloat16 logits and cast a
        float32 copy for their loss: counting the copy alone left GPT-2's planned floor 1.15
        GiB below the plan of the graph traced under CUDA's own autocast. A cast read by the
        output alone (or by views the output returns) is taken to be what the model returns
        (``return head(h).float()``). A returned view of such a cast counts as the cast, but
        stays the float32 copy's view: the forward is planned at least as high as the step,
        while at the cast's own backward step the plan can be below it by the bfloat16
        tensor. Traced under a real autocast, a cast the loss alone reads is made per slice
        (sliced_loss.py Rule 5); traced here, where it may be what the model returns, it
        stays whole, so that plan is above the step by up to the float32 copy. A plan on the
        meta device or the CPU with such a cast is traced again under the CPU's autocast
        (entry.py), where the cast is a tensor of its own: this rule is for models traced
        under no autocast.
"""

import contextlib
import operator

import torch
from torch import fx, nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils import _pytree as pytree

from .aten import DevicesOnMeta, fused_attention, storage_key, with_traced_layout
from .autocast import AutocastOnMeta
from .export import module_path
from .functions import function_called
from .graph import Layer, LayerGraph, Saved, Storage, Value
from .kinds import flops_of, kind_of
from .memo import Pattern, memo_key
from .scratch import LiveBytes, backward_scratch, one_kernel_backward
from .sliced_loss import SLICED_LOSSES


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


def _fresh_like(tensor: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """Rule 3: an independent copy of ``tensor`` with its strides (clone() makes a view with
    gaps contiguous); where it requires grad, a copy on autograd's graph (as a clone is), so
    that the layer may write it in place."""
    source = tensor.detach().requires_grad_(requires_grad)
    fresh = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype,
                                device=tensor.device)
    try:
        return fresh.copy_(source)
    except RuntimeError:
        # overlapping strides (an expanded tensor) cannot be written: a view with them
        return source.clone().as_strided(tensor.shape, tensor.stride())


def meta_like(tensor: torch.Tensor) -> torch.Tensor:
    meta = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
    return meta.requires_grad_(tensor.requires_grad)


def _layer_name(node: fx.Node, seen: dict, exported: bool) -> str:
    """A module's name for a leaf module; for an exported operation, its module and node."""
    base = node.target if node.op == "call_module" else node.name
    if exported and module_path(node):
        base = f"{module_path(node)}:{node.name}"
    seen[base] = seen.get(base, 0) + 1
    return base if seen[base] == 1 else f"{base}#{seen[base]}"


class Analyzer:
    """Walks the traced graph once, running each layer on meta tensors (Rules 2 and 3)."""

    def __init__(self, gm: fx.GraphModule, autocast=None, exported: bool = False):
        self.gm, self.exported = gm, exported
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
        self.attr_node: dict = {}     # id(meta twin) -> its get_attr node
        self.state_storage: dict = {}  # storage key of a meta twin -> a storage of no bytes
        self.layer_of: dict = {}      # fx node -> index of the layer it is
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
            self.meta_state[module] = {name: meta_like(t) for name, t in own.items()
                                       if t is not None and t.device.type != "meta"}
        return self.meta_state[module]

    def _own_buffers(self, module) -> list:
        """The buffers a leaf module not torch.nn's own runs with (their meta twins), whose
        writes a replay would read as the forward left them (policy Rule 4). torch.nn's
        modules that write buffers are norms, whose outputs in training read the batch alone
        (runtime/replay.py Rule 2)."""
        if module is None or type(module).__module__.startswith("torch.nn"):
            return []
        twins = self._state(module)
        return [twins.get(name, b) for name, b in module._buffers.items() if b is not None]

    def run(self, flat_inputs: list) -> LayerGraph:
        names, last_call_of_module, last_random = {}, {}, None
        order_deps, inputs, input_nodes, outputs, cast_from = {}, [], [], (), {}
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(flat_inputs):
            raise ValueError(f"the model takes {len(placeholders)} inputs as captured, the "
                             f"example gave {len(flat_inputs)}")
        given = dict(zip(placeholders, flat_inputs))
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                example = given[node]
                if not isinstance(example, torch.Tensor):
                    self.env[node] = example              # a constant the graph specialized on
                    continue
                storage = self._new_storage(example.untyped_storage().nbytes(), None)
                self.env[node], index = self._new_value(example, None, storage,
                                                        example.requires_grad)
                inputs.append(index)
                input_nodes.append(node)
            elif node.op == "get_attr":
                attr = operator.attrgetter(node.target)(self.gm)
                self.env[node] = meta_like(attr) if isinstance(attr, torch.Tensor) else attr
                self.attr_ids.add(id(self.env[node]))
                self.attr_node[id(self.env[node])] = node
                if isinstance(attr, torch.Tensor):
                    self.state_storage[storage_key(self.env[node])] = self._new_storage(0, None)
            elif node.op == "output":
                outputs, cast_from = self._outputs(node)
            else:
                layer, deps = self._run_layer(node, _layer_name(node, names, self.exported))
                self.layer_of[node] = layer.index
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
        if self.exported:
            self._name_by_module()
        self._order_in_place_writes(order_deps)
        self._order_state(order_deps)
        self._refuse_writes_to_saved()
        return LayerGraph(
            layers=self.layers, values=self.values, storages=self.storages,
            input_values=tuple(inputs), output_values=outputs, param_bytes=0, buffer_bytes=0,
            graph_module=self.gm, order_deps=order_deps, input_nodes=tuple(input_nodes),
            cast_from=cast_from)

    def _outputs(self, node: fx.Node) -> tuple:
        """(the values the model returns, with the inputs of the casts Rule 7 names; each such
        cast -> its input)."""
        returned, cast_from = [], {}
        fx.node.map_arg(node.args[0], returned.append)
        for made in list(returned):
            while True:
                views = self._views_up_from(made)         # a view of the cast is returned
                cast = views[-1].args[0] if views else made
                if not _cast_only_here(cast, self._storage_of, {node, *views}):
                    break
                cast_from[self._value_of(made)] = self._value_of(cast.args[0])
                made = cast.args[0]
                returned.append(made)
        tensors = [t for made in returned for t in pytree.tree_leaves(self.env.get(made))]
        outputs = tuple(dict.fromkeys(self.value_of[id(t)] for t in tensors
                                      if isinstance(t, torch.Tensor) and id(t) in self.value_of))
        return outputs, cast_from

    def _views_up_from(self, node: fx.Node) -> list:
        """``node`` and the nodes it views in turn, while each shares its input's storage here,
        last the one whose input is not such a view."""
        views = []
        while node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node) \
                and self._storage_of(node) is not None \
                and self._storage_of(node) == self._storage_of(node.args[0]):
            views.append(node)
            node = node.args[0]
        return views

    def _value_of(self, node: fx.Node) -> int | None:
        tensor = self.env.get(node)
        return self.value_of.get(id(tensor)) if isinstance(tensor, torch.Tensor) else None

    def _storage_of(self, node: fx.Node) -> int | None:
        value = self._value_of(node)
        return None if value is None else self.values[value].storage

    def _name_by_module(self) -> None:
        """A module that ran as one operation is named as the module alone."""
        count: dict = {}
        for layer in self.layers:
            count[layer.path] = count.get(layer.path, 0) + 1
        for layer in self.layers:
            if layer.path and count[layer.path] == 1:
                layer.name = layer.path

    def _order_state(self, order_deps: dict) -> None:
        """Model state written in place (running statistics) is read and written in program
        order: a writer follows every earlier reader, a reader follows the last writer."""
        readers, writer = {}, {}
        for layer in self.layers:
            deps = set()
            for node in layer.state_reads:
                if node in writer:
                    deps.add(writer[node])
            for node in layer.state_writes:
                deps.update(readers.get(node, ()))
            deps.discard(layer.index)
            if deps:
                order_deps.setdefault(layer.index, set()).update(deps)
            for node in layer.state_reads:
                readers.setdefault(node, []).append(layer.index)
            for node in layer.state_writes:
                writer[node] = layer.index

    def _refuse_writes_to_saved(self) -> None:
        """Plain PyTorch raises in backward when a tensor saved for it was written in place
        since; the runtime's saved-tensor hooks skip that check, so it is made here, before a
        step runs, for every layer whose backward takes part in the step."""
        saved_by: dict = {}       # storage -> the first layer that saved it for backward
        for layer in self.layers:
            for storage in layer.mutates:
                saver = saved_by.get(storage)
                if saver is not None and saver != layer.index:
                    first = self.layers[saver]
                    if first.node.target in SLICED_LOSSES:
                        raise ValueError(
                            f"layer {layer.name!r} ({layer.node.format_node()}) writes in place "
                            f"into the logits that the cross-entropy {first.name!r} keeps for its "
                            "backward over slices of rows (capture/sliced_loss.py); plain "
                            "PyTorch keeps their log-softmax instead and runs this. Wrap the "
                            "model with slice_loss=False.")
                    function = function_called(first.node)
                    if function is not None:
                        raise ValueError(
                            f"layer {layer.name!r} ({layer.node.format_node()}) writes in place "
                            f"into an input of the custom autograd Function {function} (layer "
                            f"{first.name!r}), which superneurons keeps to run the Function's "
                            "forward again in backward (capture/functions.py): plain PyTorch "
                            "fails here only where the Function saves that input itself. Use "
                            "the out-of-place operation (x = x * 2, not x.mul_(2)).")
                    raise ValueError(
                        f"layer {layer.name!r} ({layer.node.format_node()}) writes in place into "
                        f"a tensor that layer {first.name!r} saved for its backward; plain "
                        "PyTorch would fail in backward ('one of the variables needed for "
                        "gradient computation has been modified by an inplace operation'). Use "
                        "the out-of-place operation (x = x * 2, not x.mul_(2)).")
            if any(self.values[v].requires_grad for v in layer.outputs):
                for entry in layer.saved:
                    if entry.value is not None:
                        saved_by.setdefault(self.values[entry.value].storage, layer.index)

    def _order_in_place_writes(self, order_deps: dict) -> None:
        """Storages written in place keep program order: a layer writing a storage runs after
        every earlier reader and writer of it, and a layer reading a storage after the last
        earlier writer, also when it reads the storage through another value than the writer's
        (a mask filled slice by slice through views, then read as a whole)."""
        last_writer: dict = {}
        readers: dict = {}              # storage -> readers since its last write
        for layer in self.layers:
            reads = {self.values[v].storage for v in layer.inputs}
            deps = {last_writer[s] for s in reads if s in last_writer}
            for storage in layer.mutates:
                deps.update(readers.get(storage, ()))
                if storage in last_writer:
                    deps.add(last_writer[storage])
            deps.discard(layer.index)
            if deps:
                order_deps.setdefault(layer.index, set()).update(deps)
            for storage in reads:
                readers.setdefault(storage, set()).add(layer.index)
            for storage in layer.mutates:
                last_writer[storage] = layer.index
                readers[storage] = set()

    def _run_layer(self, node: fx.Node, name: str) -> tuple:
        """Run one layer on meta tensors: (its Layer, the layers it must follow beyond data)."""
        module = self.gm.get_submodule(node.target) if node.op == "call_module" else None
        kind = kind_of(node, module)
        index = len(self.layers)
        # Rule 3: fresh, independent inputs, so aliasing and in-place writes show as identity.
        fresh, input_values, state, deps = {}, [], {}, set()

        def prepare_tensor(obj):
            if not isinstance(obj, torch.Tensor):
                return obj
            if id(obj) in self.attr_node:
                state[self.attr_node[id(obj)]] = obj
                return obj
            if id(obj) not in self.value_of:
                return obj
            value = self.value_of[id(obj)]
            input_values.append(value)
            if value not in fresh:
                differentiable = obj.is_floating_point() or obj.is_complex()
                fresh[value] = _fresh_like(obj, self.values[value].requires_grad and differentiable)
            return fresh[value]

        def prepare(arg_node):
            if arg_node in self.layer_of:
                deps.add(self.layer_of[arg_node])   # sizes and other non-tensor results too
            return pytree.tree_map(prepare_tensor, self.env[arg_node])

        args = fx.node.map_arg(node.args, prepare)
        kwargs = fx.node.map_arg(node.kwargs, prepare)
        order = list(fresh)                       # input values in order of first use
        tensors = [fresh[v] for v in order]
        versions = {n: t._version for n, t in state.items()}
        key = memo_key(node, module, args, kwargs, {id(t): k for k, t in enumerate(tensors)})
        pattern = self.memo.get(key) if key is not None else None
        if pattern is not None:                                               # Rule 4
            result = pattern.result(tensors)
            writes_buffers = False      # memoized: a function or torch.nn's own (_own_buffers)
            mutated = list(pattern.mutated)
            scratch, random = pattern.scratch, pattern.random
            written = set()                       # a memoized call reads no model state
        else:
            buffers = self._own_buffers(module)
            versions_before = [b._version for b in buffers]
            result, packed, mutated, watch = self._run(node, module, name, args, kwargs, tensors)
            random = watch.random
            written = watch.written
            writes_buffers = any(b._version != v for b, v in zip(buffers, versions_before))
        mutates = tuple(sorted({self.values[order[k]].storage for k in mutated}))
        if set(mutates) & set(self.state_storage.values()):
            raise ValueError(
                f"layer {name!r} ({node.format_node()}) writes model state in place through a "
                "view (such as self.buffer[0].mul_(...)); superneurons cannot replay that "
                "exactly. Write the whole tensor (self.buffer.mul_(...), or index_put_ on it).")
        relaid = with_traced_layout(node, result) if self.exported else result
        outputs, self.env[node], output_ids = self._record_outputs(relaid, fresh, index)
        if relaid is not result:                     # what the layer saved is the original
            for original, tensor in zip(pytree.tree_leaves(result), pytree.tree_leaves(relaid)):
                if tensor is not original and id(tensor) in output_ids:
                    output_ids[id(original)] = output_ids[id(tensor)]
            result = relaid
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
                    ("input", order.index(entry.value)) for entry in saved], scratch, random)
        out_tensors = [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
        if node.target is torch.ops.aten.scaled_dot_product_attention.default:
            saved, scratch = fused_attention(args, kwargs, fresh, outputs)
        layer = Layer(index=index, name=name, kind=kind, node=node, inputs=tuple(input_values),
                      outputs=outputs, saved=saved, mutates=mutates, random=random,
                      module=module, forward_scratch=scratch[0], backward_scratch=scratch[1],
                      flops=flops_of(kind, node, module, args, out_tensors),
                      path=node.target if module is not None else module_path(node),
                      state_reads=tuple(state),
                      state_writes=tuple(n for n, t in state.items()
                                         if t._version != versions[n] or id(t) in written),
                      writes_buffers=writes_buffers)
        self.layers.append(layer)
        return layer, deps

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
        except NotImplementedError as error:
            raise ValueError(f"layer {name!r} cannot run on the meta device, where superneurons "
                             f"plans without allocating: {error}. Make it a module without "
                             "children, or file an issue with the model.") from error
        except Exception as error:  # the model's own error on these inputs
            if "meta tensor" in str(error):       # a value read, not the model's own error
                raise ValueError(
                    f"layer {name!r} reads a tensor's values ({str(error).rstrip('.')}), which "
                    "superneurons cannot do while it plans on the meta device, without "
                    "allocating: .item(), int(), a branch on a value, or BatchNorm with "
                    "momentum=None (its step counter). Give BatchNorm a momentum, or move the "
                    "value-reading out of the forward.") from error
            shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in tensors)
            raise ValueError(f"layer {name!r} fails on its inputs ({shapes}): "
                             f"{str(error).rstrip('.')}. Plain "
                             "PyTorch fails the same way: check the model's inputs (their "
                             "number, shapes and dtypes).") from error
        mutated = [k for k, t in enumerate(tensors) if t._version != versions[k]]
        return result, packed, mutated, watch

    def _call(self, node, module, args, kwargs):
        if node.op == "call_function":            # exported graphs name the example's device
            with DevicesOnMeta():
                return self._call_unmoved(node, module, args, kwargs)
        return self._call_unmoved(node, module, args, kwargs)

    def _call_unmoved(self, node, module, args, kwargs):
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
        # storages by identity: an output on an input's storage is that input written in place,
        # a view of it or an alias (detach() has no _base)
        by_storage = {storage_key(t): self.values[v].storage for v, t in fresh.items()}
        outputs, output_ids = [], {}

        def record(tensor):
            if not isinstance(tensor, torch.Tensor):
                return tensor
            key = storage_key(tensor)
            if key in by_storage:
                storage = by_storage[key]
            elif key in self.state_storage:        # a view of model state: resident, no bytes
                storage = self.state_storage[key]
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


def _cast_only_here(node: fx.Node, storage_of, returning: set) -> bool:
    """Rule 7: ``node`` returned a view of its first input when the graph was traced, a tensor
    of its own here (``storage_of``: a node's storage in this run), and a node other than
    ``returning`` (the output and the views it returns of ``node``) reads it: a cast read only
    on the way out is the tensor returned."""
    if not aliased_when_traced(node):
        return False
    storage = storage_of(node)
    return (storage is not None and storage != storage_of(node.args[0])
            and any(user not in returning for user in node.users))


def aliased_when_traced(node: fx.Node) -> bool:
    """Rule 7: ``node`` returned a view of its first input when the graph was traced."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    traced, traced_input = node.meta.get("val"), node.args[0].meta.get("val")
    return (isinstance(traced, torch.Tensor) and isinstance(traced_input, torch.Tensor)
            and torch._C._is_alias_of(traced, traced_input))
