"""The layer graph: leaf layers as nodes, tensors as edges, bytes from a run on the meta device.

Vocabulary:
- a *value* is one tensor some layer produced (or the model's input);
- a *storage* is the memory behind values: a view or an in-place result is a new value on an old
  storage, so memory is counted once per storage, as the Unified Tensor Pool moves it;
- what a layer *saves* is what autograd keeps for its backward: activation values (referenced by
  index) or internal tensors (BatchNorm's batch statistics, pooling indices, dropout masks).
"""

import math
from dataclasses import dataclass, field

import torch

from .kinds import Kind


@dataclass(frozen=True)
class Value:
    index: int
    producer: int | None      # layer index; None for the model's input
    storage: int
    shape: tuple
    dtype: torch.dtype
    requires_grad: bool

    @property
    def nbytes(self) -> int:
        """Its own bytes, as a gradient of it takes (a view's are fewer than its storage's)."""
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Storage:
    index: int
    nbytes: int
    creator: int | None       # the layer that allocated it; None for the model's input


@dataclass(frozen=True)
class Saved:
    """One tensor a layer's backward needs: an activation value, or internal bytes."""

    value: int | None
    nbytes: int = 0


@dataclass
class Layer:
    index: int
    name: str
    kind: Kind
    node: torch.fx.Node
    inputs: tuple = ()        # value indices, in the order the layer's arguments hold them
    outputs: tuple = ()       # value indices
    saved: tuple = ()         # Saved entries
    mutates: tuple = ()       # storage indices this layer writes in place
    random: bool = False
    module: torch.nn.Module | None = None
    forward_scratch: int = 0  # bytes its computation needs beyond l_f, then frees (scratch.py)
    backward_scratch: int = 0  # likewise beyond l_b
    flops: int = 0            # arithmetic of one forward (kinds.flops_of): a replay's cost
    path: str = ""            # the module it belongs to, for per-block summaries
    state_reads: tuple = ()   # get_attr nodes of model state it reads (parameters, buffers)
    state_writes: tuple = ()  # those it writes in place (running statistics, spectral norm)
    writes_buffers: bool = False  # a leaf module, not torch.nn's, that writes its own buffers

    @property
    def internal_saved_bytes(self) -> int:
        return sum(s.nbytes for s in self.saved if s.value is None)


@dataclass
class LayerGraph:
    """Layers in program order, with the values and storages between them."""

    layers: list
    values: list
    storages: list
    input_values: tuple
    output_values: tuple
    param_bytes: int
    buffer_bytes: int
    graph_module: torch.fx.GraphModule
    order_deps: dict = field(default_factory=dict)   # layer -> layers it must follow (not data)
    input_nodes: tuple = ()   # the placeholder behind each input value
    out_spec: object = None   # pytree spec rebuilding the model's output (exported graphs)
    in_spec: object = None    # pytree spec the model's (args, kwargs) flatten by
    # whether outputs the model's loss is computed from get gradients from outside it too:
    # seen at run time (planner/gradients.py Rule 5)
    outside_gradients: bool = False
    # trace.py Rule 7: an output made by a cast -> the output it was cast from (the model may
    # return either)
    cast_from: dict = field(default_factory=dict)
    # which reading of those a plan takes: the casts checkpoints, as outputs are, or replayed,
    # as a step's intermediates are (planner/plan.py plans both)
    replays_casts: bool = False

    @property
    def resident_bytes(self) -> int:
        """Model state that lives through the step: parameters, their gradients, buffers."""
        return 2 * self.param_bytes + self.buffer_bytes

    def layer(self, name: str) -> Layer:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(name)

    def deps(self, index: int) -> set:
        """Layers that must run before ``index``: producers of its inputs, plus ordering edges."""
        producers = {self.values[v].producer for v in self.layers[index].inputs}
        producers.discard(None)
        return producers | self.order_deps.get(index, set())
