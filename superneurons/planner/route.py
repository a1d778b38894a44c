"""The execution route: the order forward runs the layers in, and backward runs reversed.

The route is the model's own program order, the order capture recorded the operations in: a
topological order of the layer graph, where a fan's branches run as the model's code runs them
and a join runs once all its branches have.

The paper's Algorithm 1 walks the graph depth first instead. On the paper's networks (and every
network of the zoo) both orders are the same. Where they differ (an exported attention layer
whose code interleaves its q and k branches), the depth-first order is not exact: autograd
numbers each node as forward creates it and runs backward by those numbers, so a forward
reordered across branches sums gradients in another order (Qwen3's q_norm weight gradient
differed from plain PyTorch's in its last bits; tests/test_hf_paths.py fails on that order).
"""

from ..capture import LayerGraph

__all__ = ["route"]


def route(graph: LayerGraph) -> list:
    """Layer indices in forward execution order: program order, checked to be topological."""
    order = list(range(len(graph.layers)))
    for index in order:
        if any(dep >= index for dep in graph.deps(index)):
            raise ValueError(f"layer {graph.layers[index].name!r} reads a layer recorded after "
                             "it: the captured graph is not in program order; please report this")
    return order
