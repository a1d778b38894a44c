"""Gradients from outside the model into an output its own loss is computed from.

A plan counts the caller's backward as starting from the model's loss alone where a loss is
among the outputs (planner/gradients.py Rule 5): a language model given labels returns its
logits beside the loss, and a second logits-sized gradient buffer would be counted that plain
PyTorch never makes. A caller may still differentiate through those logits too (a
distillation loss beside the model's own); then that step's backward holds the outside
gradient beside the loss's, more than its plan counted.

Rule 1: the caller gets the output itself; the model's own layers read a view of it (all of
        them: the view stands for the output's layer, or for the layer before a cast that
        returns its input, planner/gradients.watched_layer). So the gradient reaching the
        output's producer is the view's (from inside) plus any from outside, and the returned
        tensor is plain PyTorch's (retain_grad, autograd.grad and the caller's hooks on it
        work as without the wrapper; an output returned twice is the same object twice).
Rule 2: a step saw an outside gradient where its producer's backward finds a gradient other
        than the one the view handed on: another buffer, or that buffer written since (added
        to in place). Where no gradient came from inside (the model's loss not
        backpropagated), the one from outside stands where the plan counted the loss's. An
        output written in place after it was returned, with autograd recording the write (a
        temperature, logits /= t), counts as seen when the inside gradient arrives: where the
        output is a view (a linear layer's on 3-D input), autograd then sends the outside
        gradient to its base, past the producer's node. A write autograd does not record
        (under no_grad, through .detach()) makes no gradient and is not counted.
Rule 3: hooks only record (a warning raised as an error inside backward would abort it); the
        wrapper says so and plans again before its next step (runtime/module.py Rule 9).
        Nothing here holds the output past its step: a forward that raised leaves its
        outputs to the next step's start, and hooks hold weak references.
"""

import weakref

import torch

from ..planner.gradients import outputs_behind_a_loss, watched_layer

__all__ = ["OutsideGradients", "seen_bytes"]


class OutsideGradients:
    """The outputs of one plan watched for a gradient from outside (Rule 1)."""

    def __init__(self, graph):
        behind = () if graph.outside_gradients else outputs_behind_a_loss(graph)
        self.nodes = {graph.layers[watched_layer(graph, v)].node for v in behind}
        self.views: dict = {}         # id(view) -> (view, its _Watch, the output), this step
        self.seen_bytes = 0           # the largest outside gradient seen; 0: none (Rule 2)

    def begin(self) -> None:
        """A step starts: a forward that raised left its views here (Rule 3)."""
        self.views.clear()

    def inside(self, node, tensor):
        """What the model's own layers read for ``node``'s ``tensor`` (Rule 1)."""
        if node not in self.nodes or not isinstance(tensor, torch.Tensor) or \
                tensor.grad_fn is None:
            return tensor
        watch = _Watch(self, tensor)
        view = tensor.view_as(tensor)
        view.register_hook(watch.from_inside)
        tensor.grad_fn.register_prehook(watch.at_producer)
        self.views[id(view)] = (view, watch, tensor)
        return view

    def returned(self, tensor):
        """What the step returns where the model returns ``tensor``: the output itself where
        ``tensor`` is its view (Rule 1)."""
        entry = self.views.get(id(tensor))
        if entry is None or entry[0] is not tensor:
            return tensor
        _, watch, original = entry
        watch.returned(original)
        return original

    def saw(self, nbytes: int) -> None:
        self.seen_bytes = max(self.seen_bytes, nbytes)


def seen_bytes(*executors) -> int:
    """The largest outside gradient any of ``executors`` (None: a plan run untouched) saw."""
    return max((e.outside.seen_bytes for e in executors if e is not None), default=0)


class _Watch:
    """One output in one step (Rule 2), holding it weakly (Rule 3)."""

    def __init__(self, outside: OutsideGradients, original: torch.Tensor):
        self.outside, self.original = outside, weakref.ref(original)
        self.output_nr = original.output_nr      # its place among its grad_fn's outputs
        self.recorded = None          # (version, autograd's node of its base) when returned
        self.handed = None            # the gradient the view handed on, and its version then

    def returned(self, original: torch.Tensor) -> None:
        self.recorded = (original._version, _base_node(original))

    def from_inside(self, gradient) -> None:
        if gradient is None:          # an undefined gradient (autograd may hand on None)
            return
        self.handed = (gradient, gradient._version)
        original = self.original() if self.recorded is not None else None
        if original is not None and original._version != self.recorded[0] and \
                _base_node(original) != self.recorded[1]:     # written, autograd recording
            self.outside.saw(gradient.nbytes)

    def at_producer(self, gradients) -> None:
        total = gradients[self.output_nr] if self.output_nr < len(gradients) else None
        handed, self.handed = self.handed, None
        if handed is None or total is None:
            return
        given, version = handed
        if total.data_ptr() != given.data_ptr() or given._version != version:
            self.outside.saw(total.nbytes)


def _base_node(tensor: torch.Tensor):
    """The sequence number of autograd's node for the tensor's base (its own where not a
    view): a write autograd records replaces it, one under no_grad or through .detach() does
    not. A view's own grad_fn is made again after any write, so it cannot tell."""
    root = tensor._base if tensor._base is not None else tensor
    return None if root.grad_fn is None else root.grad_fn._sequence_nr()
