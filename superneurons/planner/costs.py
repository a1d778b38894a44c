"""The paper's memory model: l_f and l_b per layer, and l_peak = max(l_i).

l_f(i): the storages layer i reads and writes in its forward, plus what it saves internally.
l_b(i): what its backward reads (saved activations and internal tensors), the gradient of its
        outputs it receives and the gradient of its inputs it writes.
Model state (parameters, their gradients, buffers) is resident and counted apart.
"""

from dataclasses import dataclass

from ..capture import LayerGraph

__all__ = ["LayerCosts", "layer_costs"]


@dataclass(frozen=True)
class LayerCosts:
    forward: tuple     # l_f per layer index, bytes
    backward: tuple    # l_b per layer index, bytes

    @property
    def peak(self) -> int:
        """l_peak = max(l_i): the smallest working set any execution at layer granularity needs."""
        return max(max(self.forward, default=0), max(self.backward, default=0))


def _grad_storages(graph: LayerGraph, values) -> set:
    return {graph.values[v].storage for v in values if graph.values[v].requires_grad}


def layer_costs(graph: LayerGraph) -> LayerCosts:
    size = [s.nbytes for s in graph.storages]
    forward, backward = [], []
    for layer in graph.layers:
        touched = {graph.values[v].storage for v in (*layer.inputs, *layer.outputs)}
        forward.append(sum(size[s] for s in touched) + layer.internal_saved_bytes)
        saved = {graph.values[s.value].storage for s in layer.saved if s.value is not None}
        grads = _grad_storages(graph, layer.outputs) | _grad_storages(graph, layer.inputs)
        backward.append(sum(size[s] for s in saved) + layer.internal_saved_bytes
                        + sum(size[s] for s in grads))
    return LayerCosts(tuple(forward), tuple(backward))
