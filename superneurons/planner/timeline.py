"""Where each storage is used along the step: forward steps 0..N-1, backward steps N..2N-1.

Forward step k runs route[k]; layer i's backward runs at step 2N-1-pos(i), the route reversed.
"""

from dataclasses import dataclass, field

from ..capture import Kind, LayerGraph


@dataclass
class Timeline:
    num_layers: int
    position: dict                     # layer index -> route position
    create: list                       # storage -> step it is allocated
    forward_uses: list                 # storage -> forward steps reading it
    backward_uses: list                # storage -> backward steps reading it (saved for backward)
    grad_span: list                    # storage -> (first, last) step its gradient lives, or None
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
    timeline = Timeline(n, position, [0] * num, [[] for _ in range(num)],
                        [[] for _ in range(num)], [None] * num)
    for storage in graph.storages:
        if storage.creator is not None:
            timeline.create[storage.index] = timeline.fwd(storage.creator)
    # A gradient buffer is allocated at the first backward step that writes it. A JOIN (add)
    # hands its output gradient to every input unchanged, so a JOIN allocates nothing: its
    # output gradient lives on until each input gets a buffer of its own (accumulation with
    # another consumer's gradient) or until the input's producer has run its backward.
    first_grad, joins_reading = {}, {}
    for layer in graph.layers:
        needs_grad = any(graph.values[v].requires_grad for v in layer.outputs)
        for value in layer.inputs:
            storage = graph.values[value].storage
            timeline.forward_uses[storage].append(timeline.fwd(layer.index))
            if not (needs_grad and graph.values[value].requires_grad):
                continue
            if layer.kind is Kind.JOIN:
                joins_reading.setdefault(layer.index, set()).add(storage)
                continue
            step = timeline.bwd(layer.index)
            first_grad[storage] = min(first_grad.get(storage, step), step)
        for saved in layer.saved:
            if saved.value is not None:
                timeline.backward_uses[graph.values[saved.value].storage].append(
                    timeline.bwd(layer.index))
    for value in graph.output_values:
        storage = graph.values[value].storage
        timeline.output_storages.add(storage)
        timeline.forward_uses[storage].append(n - 1)           # the loss reads the outputs
        if graph.values[value].requires_grad:
            first_grad[storage] = n                            # and sends their gradient back
    for storage, start in first_grad.items():
        creator = graph.storages[storage].creator
        if creator is not None:
            timeline.grad_span[storage] = (start, max(start, timeline.bwd(creator)))
    for join, inputs in joins_reading.items():
        for output in {graph.values[v].storage for v in graph.layers[join].outputs}:
            span = timeline.grad_span[output]
            if span is None:
                continue
            handed_to = [first_grad.get(s, timeline.bwd(graph.storages[s].creator))
                         for s in inputs if graph.storages[s].creator is not None]
            timeline.grad_span[output] = (span[0], max([span[1], *handed_to]))
    return timeline
