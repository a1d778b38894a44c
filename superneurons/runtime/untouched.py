"""What an untouched step really peaks at, against its plan (module Rule 2).

An untouched step is plain PyTorch. Its liveness plan counts its tensors, not what runs between
them: cuDNN's workspaces, which take what the device leaves, and the temporaries of kernels
made of several (plain ResNet-50 fp32 peaked 0.52 GiB above its liveness plan, GPT-2 small
1.41 GiB: benchmarks/results/untouched_margin.json). The wrapper resets the device's peak
statistic as each step's forward begins (for StepStats); when that step's backward ends, the
peak is the step's. Where it passed the plan beside the memory the model does not own, the
excess is kept for the call's key, and later steps decide with it: where plan and excess no
longer fit the budget, the step runs the managed plan made within what is left after both,
which fits its convolutions' workspaces (executor Rule 9).
"""

import logging

import torch
from torch.utils import _pytree as pytree

from ..units import format_bytes
from .calibration import peak_allocated_bytes

log = logging.getLogger(__name__)


class UntouchedWatch:
    """Per call key, the most an untouched step's real peak passed its prediction by."""

    def __init__(self):
        self.excess: dict = {}

    def watch(self, key, out, device: torch.device, predicted: int) -> None:
        """After an untouched forward that returned ``out``: when its backward ends, compare
        the step's peak with ``predicted`` (the plan's peak and the bytes the model does not
        own). Hooks on the outputs only see gradients pass; outputs without a backward (a
        leaf, a tensor that needs no gradient) are left alone."""
        queued = []

        def on_gradient(grad):
            if not queued:                   # once per forward, whichever output is first
                queued.append(True)
                torch.autograd.Variable._execution_engine.queue_callback(
                    lambda: self._ended(key, device, predicted))
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.grad_fn is not None:
                tensor.register_hook(on_gradient)

    def _ended(self, key, device: torch.device, predicted: int) -> None:
        peak = peak_allocated_bytes(device)
        if peak is None:                     # an allocator without statistics
            return
        excess = peak - predicted
        if excess > self.excess.get(key, 0):
            self.excess[key] = excess
            log.info("an untouched step peaked %s above its plan: the steps after it decide "
                     "with that", format_bytes(excess))
