"""Gradients from outside the model into an output its own loss is computed from.

A plan counts the caller's backward as starting from the model's loss alone where a loss is
among the outputs (planner/gradients.py Rule 5): a language model given labels returns its
logits beside the loss, and a second logits-sized gradient buffer would be counted that plain
PyTorch never makes. A caller may still differentiate through those logits too (a
distillation loss beside the model's own); then that step's backward holds the outside
gradient beside the loss's, more than its plan counted.

Rule 1: the caller gets the output itself; the model's own layers read a view of it. So the
        gradient reaching the output's producer is the view's (from inside) plus any from
        outside, and the returned tensor is plain PyTorch's (retain_grad, autograd.grad and
        the caller's hooks on it work as without the wrapper).
Rule 2: a step saw an outside gradient where its producer's backward finds a gradient other
        than the one the view handed on: another buffer, or that buffer written since (added
        to in place). Where no gradient came from inside (the model's loss not
        backpropagated), the one from outside stands where the plan counted the loss's. An
        output written in place after it was returned (a temperature, logits /= t) counts as
        seen when the inside gradient arrives: where the output is a view (a linear layer's
        on 3-D input), autograd then sends the outside gradient to its base, past the
        producer's node.
Rule 3: hooks only record (a warning raised as an error inside backward would abort it); the
        wrapper says so and plans again before its next step (runtime/module.py Rule 9).
"""

import weakref

import torch

from ..planner.gradients import outputs_behind_a_loss

__all__ = ["OutsideGradients"]


class OutsideGradients:
    """The outputs of one plan watched for a gradient from outside (Rule 1)."""

    def __init__(self, graph):
        behind = () if graph.outside_gradients else outputs_behind_a_loss(graph)
        self.nodes = {graph.layers[graph.values[v].producer].node for v in behind}
        self.watches: dict = {}       # node -> this step's _Watch, until the output is returned
        self.seen_bytes = 0           # the largest outside gradient seen; 0: none (Rule 2)

    def inside(self, node, tensor):
        """What the model's own layers read for ``node``'s ``tensor`` (Rule 1)."""
        if node not in self.nodes or not isinstance(tensor, torch.Tensor) or \
                tensor.grad_fn is None:
            return tensor
        watch = self.watches[node] = _Watch(self, tensor)
        view = tensor.view_as(tensor)
        view.register_hook(watch.from_inside)
        tensor.grad_fn.register_prehook(watch.at_producer)
        return view

    def returned(self, node, tensor):
        """What the step returns for ``node``: the output itself (Rule 1)."""
        watch = self.watches.pop(node, None)
        if watch is None:
            return tensor
        original = watch.original
        watch.returned(original)
        return original

    def saw(self, nbytes: int) -> None:
        self.seen_bytes = max(self.seen_bytes, nbytes)


class _Watch:
    """One output in one step (Rule 2). Holds the output until it is returned, then a weak
    reference: the caller's tensor must not live on in a hook."""

    def __init__(self, outside: OutsideGradients, original: torch.Tensor):
        self.outside, self.original = outside, original
        self.version = None           # the output's version when returned
        self.handed = None            # the gradient the view handed on, and its version then

    def returned(self, original: torch.Tensor) -> None:
        self.original, self.version = weakref.ref(original), original._version

    def from_inside(self, gradient) -> None:
        if gradient is None:          # an undefined gradient (autograd may hand on None)
            return
        self.handed = (gradient, gradient._version)
        original = self.original() if self.version is not None else None
        if original is not None and original._version != self.version:
            self.outside.saw(gradient.nbytes)

    def at_producer(self, gradients) -> None:
        total = gradients[0] if gradients else None
        handed, self.handed = self.handed, None
        if handed is None or total is None:
            return
        given, version = handed
        if total.data_ptr() != given.data_ptr() or given._version != version:
            self.outside.saw(total.nbytes)
