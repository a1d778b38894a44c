"""The paper's memory model: l_f and l_b per layer, and l_peak = max(l_i).

l_f(i): the storages layer i reads and writes in its forward, plus what it saves internally,
        plus the scratch its forward frees before it returns (capture/scratch.py).
l_b(i): what its backward reads (saved activations and internal tensors), the gradient of its
        outputs it receives and the gradient of its inputs it writes, plus its scratch.
Model state (parameters, their gradients, buffers) is resident and counted apart.
work(i): what replaying layer i's forward costs, in bytes of device-memory traffic: the bytes its
        forward touches, plus its arithmetic (capture's flops: convolutions, matrix products,
        attention) at FLOPS_PER_BYTE (an H100/H200 in TF32 does
        ~100 flops in the time its memory moves one byte). A convolution costs its arithmetic, a
        ReLU its bytes: this is what choosing between replaying cheap layers and whole blocks
        weighs.
LINK_COST: a byte sent to the host and back costs as much time as this many bytes of
        device-memory traffic (an H200: ~3 TB/s on the device, 55 GB/s each way to the host).
"""

from dataclasses import dataclass
from functools import cached_property

from ..capture import LayerGraph

__all__ = ["LayerCosts", "layer_costs", "FLOPS_PER_BYTE", "LINK_COST"]

FLOPS_PER_BYTE = 100
LINK_COST = 100


@dataclass(frozen=True)
class LayerCosts:
    forward: tuple     # l_f per layer index, bytes
    backward: tuple    # l_b per layer index, bytes
    work: tuple        # replay cost per layer index, bytes of memory traffic (see above)

    @cached_property     # the planner asks for it once per segment, on thousands of segments
    def peak(self) -> int:
        """l_peak = max(l_i): the smallest working set any execution at layer granularity needs."""
        return max(max(self.forward, default=0), max(self.backward, default=0))


def _grad_storages(graph: LayerGraph, values) -> set:
    return {graph.values[v].storage for v in values if graph.values[v].requires_grad}


def layer_costs(graph: LayerGraph) -> LayerCosts:
    size = [s.nbytes for s in graph.storages]
    forward, backward, work = [], [], []
    for layer in graph.layers:
        touched = {graph.values[v].storage for v in (*layer.inputs, *layer.outputs)}
        forward.append(sum(size[s] for s in touched) + layer.internal_saved_bytes
                       + layer.forward_scratch)
        saved = {graph.values[s.value].storage for s in layer.saved if s.value is not None}
        grads = _grad_storages(graph, layer.outputs) | _grad_storages(graph, layer.inputs)
        backward.append(sum(size[s] for s in saved) + layer.internal_saved_bytes
                        + sum(size[s] for s in grads) + layer.backward_scratch)
        work.append(forward[-1] + layer.flops // FLOPS_PER_BYTE)
    return LayerCosts(tuple(forward), tuple(backward), tuple(work))
