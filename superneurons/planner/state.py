"""Model state kept on the host (the state tier): what streaming it costs each step of the plan,
and which of it stays resident on the device where the budget has room.

With state="host" the parameters, their gradients and the buffers live in host memory, and a
layer reads device copies of them (runtime/state.py). Each layer adds its own, transient:
- forward: the copies of all the streamed state it reads, fetched one layer ahead (they live at
  the step before the layer's and at its own);
- backward: the streamed parameters that take gradients are fetched again (one step ahead, as
  in forward), and the gradients of all its trained parameters live until their copy to the
  host is done (taken as the next step);
- a replayed segment fetches the streamed state of the layer it runs (one at a time).
A parameter read by several layers (shared weights) is fetched by each.

Resident state (runtime state.py Rule 7) is a buffer live over the whole step instead: it is
fetched once a step, in forward, and its copy serves every reader, replay and backward; a
trained parameter's gradient still goes to the host. Frozen state moves every step too: a write
to it that counts no version (an EMA teacher's `p.data.mul_(...)`) would go unseen by a copy
kept across steps. State some layer writes in place (running statistics) is never resident:
its copy goes back to the host after the writer (runtime state.py Rule 4). choose_resident picks
the set by fetches saved a step per byte held (the same for every byte of one tensor: a count),
ties by use order, while their bytes fit the room given.
"""

import operator
from collections import Counter
from dataclasses import dataclass

from ..capture import LayerGraph
from .predict import Buffer

__all__ = ["LayerState", "StateTensor", "state_tensors", "layer_state", "state_buffers",
           "state_bytes_moved", "choose_resident", "STATES"]

STATES = ("device", "host")


@dataclass(frozen=True)
class StateTensor:
    name: str        # where the runtime finds it: the model's (or the graph's) attribute path
    nbytes: int      # its storage's bytes: a copy moves a storage
    trained: bool    # requires_grad: its gradient goes to the host
    written: bool    # some layer writes it in place: never resident
    readers: tuple   # the layers that read it, by index


@dataclass(frozen=True)
class LayerState:
    fetched: int      # bytes of the streamed (not resident) state the layer reads
    again: int        # those that take gradients: fetched again for backward
    grads: int        # bytes of the gradients of all the trained state it reads, sent to host


def _reads(graph: LayerGraph, layer, written: set):
    """(name, tensor, written) of the state ``layer`` reads."""
    if layer.module is not None:
        prefix = f"{layer.path}." if layer.path else ""
        for name, tensor in layer.module.named_parameters(remove_duplicate=False):
            yield prefix + name, tensor, False
        # a leaf module's buffers all go back to the host after its forward (runtime state.py
        # Rule 4: native_batch_norm writes running statistics without counting a version)
        for name, tensor in layer.module.named_buffers(remove_duplicate=False):
            yield prefix + name, tensor, True
    for node in layer.state_reads:
        yield node.target, operator.attrgetter(node.target)(graph.graph_module), node in written


def state_tensors(graph: LayerGraph) -> tuple:
    """Every state tensor the step reads, once (tied weights are one tensor), in read order.
    Kept on the graph while no requires_grad changes: a budget's search builds tens of plans
    of one graph, and listing walks every layer's module."""
    trained = tuple(p.requires_grad for p in graph.graph_module.parameters())
    kept = getattr(graph, "_state_tensors", None)
    if kept is None or kept[0] != trained:
        kept = graph._state_tensors = (trained, _state_tensors(graph))
    return kept[1]


def _state_tensors(graph: LayerGraph) -> tuple:
    written = {node for layer in graph.layers for node in layer.state_writes}
    found: dict = {}                      # id(tensor) -> [name, tensor, written, readers]
    for layer in graph.layers:
        for name, tensor, writes in _reads(graph, layer, written):
            entry = found.setdefault(id(tensor), [name, tensor, False, []])
            entry[2] = entry[2] or writes
            if not entry[3] or entry[3][-1] != layer.index:
                entry[3].append(layer.index)
    return tuple(StateTensor(name, tensor.untyped_storage().nbytes(), tensor.requires_grad,
                             writes, tuple(readers))
                 for name, tensor, writes, readers in found.values())


def layer_state(graph: LayerGraph, tensors: tuple, resident=frozenset()) -> tuple:
    """Per layer index, the state it streams and the gradients it sends, ``resident`` (names)
    kept on the device."""
    states = [[0, 0, 0] for _ in graph.layers]
    for tensor in tensors:
        for index in tensor.readers:
            state = states[index]
            if tensor.name not in resident:
                state[0] += tensor.nbytes
                state[1] += tensor.nbytes if tensor.trained else 0
            state[2] += tensor.nbytes if tensor.trained else 0
    return tuple(LayerState(*state) for state in states)


def state_buffers(graph: LayerGraph, timeline, segments: list, needs, states: tuple) -> list:
    last_step = timeline.num_steps - 1
    buffers = []
    for layer, state in zip(graph.layers, states):
        forward, backward = timeline.fwd(layer.index), timeline.bwd(layer.index)
        if state.fetched:
            buffers.append(Buffer(f"{layer.name}:state", state.fetched,
                                  ((max(forward - 1, 0), forward),)))
        if state.again:
            buffers.append(Buffer(f"{layer.name}:state again", state.again,
                                  ((backward - 1, backward),)))
        if state.grads:
            buffers.append(Buffer(f"grad({layer.name}:state)", state.grads,
                                  ((backward, min(backward + 1, last_step)),)))
    for segment in segments:
        for step, last in needs.replays[segment.index]:
            largest = max(states[l].fetched for l in segment.layers[:last + 1])
            if largest:
                buffers.append(Buffer("replayed state", largest, ((step, step),)))
    return buffers


def state_bytes_moved(segments: list, needs, states: tuple, tensors: tuple = (),
                      resident=frozenset()) -> int:
    """Bytes of state sent over the host link a step: every copy of streamed state to the
    device (forward, backward, replays), every gradient back, and each resident tensor once."""
    moved = sum(s.fetched + s.again + s.grads for s in states)
    for segment in segments:
        for _, last in needs.replays[segment.index]:
            moved += sum(states[l].fetched for l in segment.layers[:last + 1])
    return moved + sum(t.nbytes for t in tensors if t.name in resident)


def choose_resident(tensors: tuple, segments: list, needs, timeline, room: int) -> tuple:
    """The names of the state kept resident within ``room`` bytes (module docstring)."""
    replayed = Counter(l for segment in segments for _, last in needs.replays[segment.index]
                       for l in segment.layers[:last + 1])

    def fetches_saved(tensor: StateTensor) -> int:
        """Copies to the device a step that residence saves: each reader's, each replay's and
        each backward's (frozen weights too: their layer's backward reads them for the input's
        gradient), less the one it keeps."""
        return sum(2 + replayed[l] for l in tensor.readers) - 1

    candidates = sorted((t for t in tensors if not t.written and t.nbytes),
                        key=lambda t: (-fetches_saved(t),
                                       min(timeline.fwd(l) for l in t.readers)))
    chosen, held = [], 0
    for tensor in candidates:
        if held + tensor.nbytes <= room:
            chosen.append(tensor.name)
            held += tensor.nbytes
    return tuple(chosen)
