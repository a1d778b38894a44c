"""The paper's memory model, l_f and l_b per layer and l_peak = max(l_i), and what replays and
moves cost in time on the machine that runs them.

l_f(i): the storages layer i reads and writes in its forward, plus what it saves internally,
        plus the scratch its forward frees before it returns (capture/scratch.py).
l_b(i): what its backward reads (saved activations and internal tensors), the gradient of its
        outputs it receives and the gradient of its inputs it writes, plus its scratch.
Model state (parameters, their gradients, buffers) is resident and counted apart.
work(i): seconds to replay layer i's forward on a Machine: the longer of moving the bytes its
        forward touches through device memory and doing its arithmetic (capture's flops:
        convolutions, matrix products, attention) at the machine's rate for its kind and dtype.
        A convolution costs its arithmetic, a ReLU its bytes: this is what choosing between
        replaying cheap layers and whole blocks weighs.
Machine.move_seconds: a byte sent to the host and back, over the measured link.
Machine.pool_bytes: what the Tensor Pool counts for a tensor it holds (pool Rule 5): rounded up
        to the allocator's page, or its small block for tensors the allocator keeps in small
        segments, so that a plan said to move nothing fits what the pool will count.
"""

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property

import torch

from ..capture import Kind, LayerGraph

__all__ = ["LayerCosts", "layer_costs", "Machine", "H200", "OFF_CUDA", "CUDA_PAGE_BYTES"]

# the CUDA caching allocator's page: a tensor the pool frees between live ones leaves its pages
# partly used, and the pool counts each entry rounded up to it (runtime/pool.py Rule 5)
CUDA_PAGE_BYTES = 2 << 20
# requests up to this size share the allocator's small segments, each rounded up to its
# smallest block (CUDACachingAllocator.cpp, kSmallSize and kMinBlockSize): one freed between live
# ones leaves a sliver of a page the other small tensors share, not a page of its own
CUDA_SMALL_BYTES, CUDA_SMALL_BLOCK_BYTES = 1 << 20, 512


@dataclass(frozen=True)
class Machine:
    """Rates of one device: memory traffic, arithmetic per kind and dtype, host link each way.
    runtime/machine.py measures them on the device a plan runs on."""

    memory_bytes_per_s: float
    conv_flops_per_s: dict = field(hash=False)     # dtype name -> rate of convolutions
    matmul_flops_per_s: dict = field(hash=False)   # dtype name -> rate of FC, matmul, attention
    link_bytes_per_s: float = 1.0                  # pinned host memory, one way
    source: str = ""
    pool_page_bytes: int = CUDA_PAGE_BYTES         # 1 where the pool counts bytes as they are
    pool_small_bytes: int = CUDA_SMALL_BYTES       # up to this, counted in small blocks
    pool_small_block_bytes: int = CUDA_SMALL_BLOCK_BYTES

    def pool_bytes(self, nbytes: int) -> int:
        """What the Tensor Pool counts for a tensor of ``nbytes`` it holds."""
        granule = self.pool_small_block_bytes if nbytes <= self.pool_small_bytes else \
            self.pool_page_bytes
        return -(-nbytes // granule) * granule

    def replay_seconds(self, nbytes: int, flops: int, kind: Kind, dtype: torch.dtype) -> float:
        rates = self.conv_flops_per_s if kind is Kind.CONV else self.matmul_flops_per_s
        rate = rates.get(str(dtype).removeprefix("torch."), rates["float32"])
        return max(nbytes / self.memory_bytes_per_s, flops / rate)

    def move_seconds(self, nbytes: int) -> float:
        """Out to the host and back."""
        return 2 * nbytes / self.link_bytes_per_s


# The rates the planner assumes where it cannot measure (a plan made on the CPU or the meta
# device, for a GPU): an H200 under PyTorch's default TF32 settings (TF32 convolutions, fp32
# matrix products), the median of three measurements by runtime/machine.py (BENCHMARKS.md,
# "The machine the planner weighs").
H200 = Machine(memory_bytes_per_s=2.31e12,
               conv_flops_per_s={"float32": 2.0e14, "bfloat16": 3.5e14, "float16": 3.5e14},
               matmul_flops_per_s={"float32": 4.8e13, "bfloat16": 4.3e14, "float16": 4.2e14},
               link_bytes_per_s=5.43e10, source="H200 defaults")
# a run off CUDA: the pool counts what it holds byte for byte; the rates weigh nothing it runs
OFF_CUDA = dataclasses.replace(H200, pool_page_bytes=1, pool_small_bytes=0,
                               source="H200 defaults, off CUDA")


@dataclass(frozen=True)
class LayerCosts:
    forward: tuple     # l_f per layer index, bytes
    backward: tuple    # l_b per layer index, bytes
    work: tuple        # replay cost per layer index, seconds on ``machine``
    machine: Machine = H200

    @cached_property     # the planner asks for it once per segment, on thousands of segments
    def peak(self) -> int:
        """l_peak = max(l_i): the smallest working set any execution at layer granularity needs."""
        return max(max(self.forward, default=0), max(self.backward, default=0))


def _grad_storages(graph: LayerGraph, values) -> set:
    return {graph.values[v].storage for v in values if graph.values[v].requires_grad}


def _compute_dtype(graph: LayerGraph, layer) -> torch.dtype:
    """The dtype a layer computes in: its first floating output's (under autocast, a
    convolution's bf16 output)."""
    for v in layer.outputs:
        if graph.values[v].dtype.is_floating_point:
            return graph.values[v].dtype
    return torch.float32


def layer_costs(graph: LayerGraph, machine: Machine = H200) -> LayerCosts:
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
        work.append(machine.replay_seconds(forward[-1], layer.flops, layer.kind,
                                           _compute_dtype(graph, layer)))
    return LayerCosts(tuple(forward), tuple(backward), tuple(work), machine)
