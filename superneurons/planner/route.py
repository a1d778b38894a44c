"""The execution route: the paper's Algorithm 1.

Depth-first from the input; a layer joins the route only once every layer it depends on is in
it (the join counter), so fans run branch after branch and a join waits for all its branches.
Backward is the route reversed. Written with an explicit stack: networks of thousands of layers
would overflow Python's recursion limit.
"""

from ..capture import LayerGraph

__all__ = ["route"]


def route(graph: LayerGraph) -> list:
    """Layer indices in forward execution order (a topological order of ``graph``)."""
    num_layers = len(graph.layers)
    deps = [graph.deps(i) for i in range(num_layers)]
    children = [[] for _ in range(num_layers)]
    for index in range(num_layers):
        for parent in sorted(deps[index]):
            children[parent].append(index)
    for kids in children:
        kids.sort()           # visit consumers in program order, as the model's code wrote them
    counters = [0] * num_layers
    roots = [i for i in range(num_layers) if not deps[i]]
    order, stack = [], list(reversed(roots))
    while stack:
        layer = stack.pop()
        counters[layer] += 1
        if counters[layer] < len(deps[layer]):
            continue          # Alg. 1 line 5: wait for the remaining inputs
        order.append(layer)
        stack.extend(reversed(children[layer]))
    assert len(order) == num_layers, "the layer graph has a cycle"
    return order
