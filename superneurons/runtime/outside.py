"""Gradients from outside the model into an output its own loss is computed from.

A plan counts the caller's backward as starting from the model's loss alone where the loss is
among the outputs (planner/gradients.py Rule 5): a language model given labels returns its
logits beside the loss, and a second logits-sized gradient buffer would be counted that plain
PyTorch never makes. A caller may still differentiate through those logits too (a
distillation loss beside the model's own); then that step's backward holds the outside
gradient beside the loss's, more than its plan counted.

Rule 1: such an output is returned as a view of itself with a gradient hook. The model's own
        layers read the original, so only a gradient from outside reaches the view: its hook
        runs exactly when the plan's assumption failed. The view's backward hands the gradient
        on unchanged to the original, where autograd adds it to the loss's as it would have.
Rule 2: the hook warns and records the bytes; the wrapper plans again for the next step with
        outside gradients counted for every output (runtime/module.py Rule 9). The step it
        ran in may pass its budget by up to those bytes: the plan was made before the caller's
        loss existed.
"""

import warnings

import torch

from ..units import format_bytes
from ..planner.gradients import outputs_behind_a_loss

__all__ = ["OutsideGradients"]


class OutsideGradients:
    """The outputs of one plan that are watched for a gradient from outside (Rule 1)."""

    def __init__(self, graph):
        behind = () if graph.outside_gradients else outputs_behind_a_loss(graph)
        self.nodes = {graph.layers[graph.values[v].producer].node: graph.values[v].nbytes
                      for v in behind}
        self.seen_bytes = 0           # the largest outside gradient seen; 0: none (Rule 2)

    def returned(self, node, tensor):
        """What the step returns for ``node``'s ``tensor``."""
        if node not in self.nodes or not isinstance(tensor, torch.Tensor) or \
                not tensor.requires_grad:
            return tensor
        view = tensor.view_as(tensor)
        view.register_hook(self._seen)
        return view

    def _seen(self, gradient: torch.Tensor) -> None:
        if not self.seen_bytes:
            warnings.warn(
                f"superneurons: a gradient of {format_bytes(gradient.nbytes)} reached an output "
                "the model's loss is computed from, from outside the model: its plan counted "
                "the backward of the model's loss alone, so this step may pass the budget by "
                "up to those bytes. The next step is planned with it.", stacklevel=2)
        self.seen_bytes = max(self.seen_bytes, gradient.nbytes)
