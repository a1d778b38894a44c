"""Where each storage is used along the step: forward steps 0..N-1, backward steps N..2N-1.

Forward step k runs route[k]; layer i's backward runs at step 2N-1-pos(i), the route reversed.
"""

from dataclasses import dataclass, field

from ..capture import LayerGraph
from .gradients import gradient_buffers


@dataclass
class Timeline:
    num_layers: int
    position: dict                     # layer index -> route position
    create: list                       # storage -> step it is allocated
    forward_uses: list                 # storage -> forward steps reading it
    backward_uses: list                # storage -> backward steps reading it (saved for backward)
    grad_buffers: list = field(default_factory=list)  # gradients.py's (value, first, last, bytes)
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
    timeline.grad_buffers = gradient_buffers(graph, timeline)
    return timeline
