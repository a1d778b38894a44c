"""Where each storage is used along the step: forward steps 0..N-1, backward steps N..2N-1.

Forward step k runs route[k]; layer i's backward runs at step 2N-1-pos(i), the route reversed.
"""

from dataclasses import dataclass, field

from ..capture import Kind, LayerGraph

# Layers whose backward hands its output's gradient to its inputs without allocating: an add
# passes the same tensor to each input, a concatenation a slice of it to each.
PASS_THROUGH = (Kind.JOIN, Kind.CONCAT)


@dataclass
class Timeline:
    num_layers: int
    position: dict                     # layer index -> route position
    create: list                       # storage -> step it is allocated
    forward_uses: list                 # storage -> forward steps reading it
    backward_uses: list                # storage -> backward steps reading it (saved for backward)
    grad_buffers: list = field(default_factory=list)  # (storage, first, last): backward's buffers
    output_storages: set = field(default_factory=set)

    @property
    def num_steps(self) -> int:
        return 2 * self.num_layers

    def fwd(self, layer: int) -> int:
        return self.position[layer]

    def bwd(self, layer: int) -> int:
        return 2 * self.num_layers - 1 - self.position[layer]

    def last_forward_use(self, storage: int) -> int:
        return max(self.forward_uses[storage], default=self.create[storage])


def build_timeline(graph: LayerGraph, order: list) -> Timeline:
    n = len(order)
    position = {layer: p for p, layer in enumerate(order)}
    num = len(graph.storages)
    timeline = Timeline(n, position, [0] * num, [[] for _ in range(num)], [[] for _ in range(num)])
    for storage in graph.storages:
        if storage.creator is not None:
            timeline.create[storage.index] = timeline.fwd(storage.creator)
    for layer in graph.layers:
        for value in layer.inputs:
            timeline.forward_uses[graph.values[value].storage].append(timeline.fwd(layer.index))
        for saved in layer.saved:
            if saved.value is not None:
                timeline.backward_uses[graph.values[saved.value].storage].append(
                    timeline.bwd(layer.index))
    for value in graph.output_values:
        storage = graph.values[value].storage
        timeline.output_storages.add(storage)
        timeline.forward_uses[storage].append(n - 1)           # the loss reads the outputs
    timeline.grad_buffers = _GradientFlow(graph, timeline, order).buffers()
    return timeline


class _GradientFlow:
    """Autograd's gradient buffers, step by step through backward, by storage.

    Each storage has a slot (autograd's input buffer for its producer) that holds a reference to
    one gradient buffer, from the first gradient that reaches it until its creator's backward ran.
    1. A layer's backward allocates a fresh buffer for each input, except a PASS_THROUGH layer,
       whose inputs' slots refer to the buffer holding its output's gradient (a slice of it, for
       a concatenation), and a view, whose gradient is a view of its output's. An in-place
       layer's fresh buffer replaces its storage's gradient, both live through its step.
    2. A second gradient reaching a slot is added in place when the slot holds a whole buffer no
       other slot refers to; otherwise the sum is a fresh buffer and the slot lets go of the old.
       The incoming fresh buffer lives only through that step.
    3. A buffer lives until no slot refers to it.
    """

    def __init__(self, graph: LayerGraph, timeline: Timeline, order: list):
        self.graph, self.timeline, self.order = graph, timeline, order
        self.created_by: dict = {}    # layer -> storages it allocated
        for storage in graph.storages:
            self.created_by.setdefault(storage.creator, []).append(storage.index)
        self.made: list = []          # [storage, first, last] per buffer
        self.refs: list = []          # buffer -> storages whose slots refer to it
        self.slot: dict = {}          # storage -> (buffer, whether it holds a slice of it)

    def buffers(self) -> list:
        graph, n = self.graph, self.timeline.num_layers
        for value in graph.output_values:
            storage = graph.values[value].storage
            if graph.values[value].requires_grad and storage not in self.slot:
                self._receive(storage, self._new(storage, n), False, n)
        for layer_index in reversed(self.order):
            self._backward(graph.layers[layer_index], self.timeline.bwd(layer_index))
        last_step = self.timeline.num_steps - 1
        return [(storage, first, last if not self.refs[b] else last_step)
                for b, (storage, first, last) in enumerate(self.made)]

    def _backward(self, layer, step: int) -> None:
        graph = self.graph
        outputs = {graph.values[v].storage for v in layer.outputs if graph.values[v].requires_grad}
        passes = layer.kind in PASS_THROUGH and len(outputs) == 1
        for value in dict.fromkeys(layer.inputs) if outputs else ():
            storage = graph.values[value].storage
            if not graph.values[value].requires_grad or graph.storages[storage].creator is None:
                continue
            if storage in outputs:        # a view's gradient is a view: the slot stays as is
                if storage in layer.mutates and not passes and storage in self.slot:
                    self._let_go(storage, step)      # in place (ReLU(inplace=True)): a fresh
                    self._receive(storage, self._new(storage, step), False, step)  # gradient
                continue
            if passes and self._handed_whole_or_sliced(layer, value):
                held = self.slot.get(next(iter(outputs)))
                if held is not None:
                    self._receive(storage, held[0], layer.kind is Kind.CONCAT, step)
            else:
                self._receive(storage, self._new(storage, step), False, step)
        for storage in self.created_by.get(layer.index, ()):
            self._let_go(storage, step)

    def _handed_whole_or_sliced(self, layer, value) -> bool:
        """An add reduces the gradient of an input it broadcast: that one is a fresh buffer."""
        return layer.kind is Kind.CONCAT or all(
            self.graph.values[out].shape == self.graph.values[value].shape
            for out in layer.outputs)

    def _new(self, storage: int, step: int) -> int:
        self.made.append([storage, step, step])
        self.refs.append(set())
        return len(self.made) - 1

    def _receive(self, storage: int, buffer: int, sliced: bool, step: int) -> None:
        if storage not in self.slot:
            self.slot[storage] = (buffer, sliced)
            self.refs[buffer].add(storage)
            return
        old, old_sliced = self.slot[storage]
        if old == buffer:
            return
        if old_sliced or self.refs[old] != {storage}:      # Rule 2: the sum is a fresh buffer
            self._let_go(storage, step)
            self._receive(storage, self._new(storage, step), False, step)
        # the incoming buffer, when fresh, is referred to by no slot: it ends at this step

    def _let_go(self, storage: int, step: int) -> None:
        held = self.slot.pop(storage, None)
        if held is None:
            return
        self.refs[held[0]].discard(storage)
        if not self.refs[held[0]]:
            self.made[held[0]][2] = step
