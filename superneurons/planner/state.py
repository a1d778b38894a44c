"""Model state kept on the host (the state tier): what streaming it costs each step of the plan.

With state="host" the parameters, their gradients and the buffers live in host memory, and a
layer reads device copies of them (runtime/state.py). The plan's resident state is then zero,
and each layer adds its own, transient:
- forward: the copies of all the state it reads, fetched one layer ahead (they live at the step
  before the layer's and at its own);
- backward: the parameters that take gradients are fetched again (one step ahead, as in
  forward), and their gradients live until their copy to the host is done (taken as the next
  step);
- a replayed segment fetches the state of the layer it runs (one at a time).
A parameter read by several layers (shared weights) is fetched by each.
"""

import operator
from dataclasses import dataclass

from ..capture import LayerGraph
from .predict import Buffer

__all__ = ["LayerState", "layer_state", "state_buffers", "state_bytes_moved", "STATES"]

STATES = ("device", "host")


@dataclass(frozen=True)
class LayerState:
    fetched: int      # bytes of the parameters and buffers the layer reads
    trained: int      # bytes of those that take gradients: fetched again, and their gradients


def _tensors_of(graph: LayerGraph, layer) -> list:
    found = {}
    if layer.module is not None:
        for tensor in (*layer.module.parameters(), *layer.module.buffers()):
            found[id(tensor)] = tensor
    for node in layer.state_reads:
        tensor = operator.attrgetter(node.target)(graph.graph_module)
        found[id(tensor)] = tensor
    return list(found.values())


def layer_state(graph: LayerGraph) -> tuple:
    """Per layer index, the state it reads (whole storages: a copy moves a storage)."""
    states = []
    for layer in graph.layers:
        fetched = trained = 0
        for tensor in _tensors_of(graph, layer):
            nbytes = tensor.untyped_storage().nbytes()
            fetched += nbytes
            if tensor.requires_grad:
                trained += nbytes
        states.append(LayerState(fetched, trained))
    return tuple(states)


def state_buffers(graph: LayerGraph, timeline, segments: list, needs, states: tuple) -> list:
    last_step = timeline.num_steps - 1
    buffers = []
    for layer, state in zip(graph.layers, states):
        if not state.fetched:
            continue
        forward, backward = timeline.fwd(layer.index), timeline.bwd(layer.index)
        buffers.append(Buffer(f"{layer.name}:state", state.fetched,
                              ((max(forward - 1, 0), forward),)))
        if state.trained:
            buffers.append(Buffer(f"{layer.name}:state again", state.trained,
                                  ((backward - 1, backward),)))
            buffers.append(Buffer(f"grad({layer.name}:state)", state.trained,
                                  ((backward, min(backward + 1, last_step)),)))
    for segment in segments:
        for step, last in needs.replays[segment.index]:
            largest = max(states[l].fetched for l in segment.layers[:last + 1])
            if largest:
                buffers.append(Buffer("replayed state", largest, ((step, step),)))
    return buffers


def state_bytes_moved(segments: list, needs, states: tuple) -> int:
    """Bytes of state sent over the host link a step: every copy to the device (forward,
    backward, replays) and every gradient back."""
    moved = sum(s.fetched + 2 * s.trained for s in states)
    for segment in segments:
        for _, last in needs.replays[segment.index]:
            moved += sum(states[l].fetched for l in segment.layers[:last + 1])
    return moved
