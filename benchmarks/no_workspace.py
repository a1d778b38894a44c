"""cuDNN without workspace headroom, for the workspace part's comparison.

In benchmark mode PyTorch chooses each convolution's algorithm the first time it meets its
shapes, trying candidates' workspaces in whatever memory the caching allocator can give at that
moment and dropping those that do not fit. `DenyWorkspace` takes, around every convolution of the
warm-up steps, all the memory under the cap that the convolution's own outputs do not need, so
only algorithms with (almost) no workspace are chosen; the timed steps then run those choices
with no filler and no hook. (CUDNN_CONV_WSCAP_DBG changed nothing in this build:
results/workspace_wscap0.json, results/workspace_wscap1.json.) The record counts the convolutions the
mode saw: the backward's should be there too (autograd carries dispatch modes to its threads);
if only the forward's are, only forward algorithms were constrained.
"""

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_SLOP = 32 << 20          # allocator rounding of the outputs
_SMALLEST_FILLER = 1 << 20


def _output_bytes(input: torch.Tensor, weight: torch.Tensor, stride, padding, dilation,
                  transposed: bool, output_padding, groups: int) -> int:
    spatial = []
    for i, size in enumerate(input.shape[2:]):
        kernel = dilation[i] * (weight.shape[2 + i] - 1) + 1
        if transposed:
            spatial.append((size - 1) * stride[i] - 2 * padding[i] + kernel + output_padding[i])
        else:
            spatial.append((size + 2 * padding[i] - kernel) // stride[i] + 1)
    channels = weight.shape[1] * groups if transposed else weight.shape[0]
    return input.shape[0] * channels * math.prod(spatial) * input.element_size()


def needed_bytes(func, args) -> int:
    """What a convolution allocates for its results (forward: the output; backward: the
    gradients its output mask asks for)."""
    if func is aten.convolution.default:
        input, weight, _, stride, padding, dilation, transposed, output_padding, groups = args
        return _output_bytes(input, weight, stride, padding, dilation, transposed,
                             output_padding, groups)
    _, input, weight, bias_sizes, *_, mask = args
    nbytes = [input.numel() * input.element_size(), weight.numel() * weight.element_size(),
              math.prod(bias_sizes or [0]) * weight.element_size()]
    return sum(n for n, wanted in zip(nbytes, mask) if wanted)


class DenyWorkspace(TorchDispatchMode):
    """Around each convolution, fill the memory under ``cap_bytes`` that its results do not
    need (``allocated`` reads the bytes in use)."""

    CONVOLUTIONS = (aten.convolution.default, aten.convolution_backward.default)

    def __init__(self, cap_bytes: int, device="cuda", allocated=None):
        super().__init__()
        self.cap_bytes, self.device = cap_bytes, device
        self.allocated = allocated or (lambda: torch.cuda.memory_allocated(device))
        self.filled_bytes = []           # per convolution, for the record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self.CONVOLUTIONS:
            return func(*args, **kwargs)
        needed = needed_bytes(func, args) + _SLOP
        fillers = self._fill(self.cap_bytes - self.allocated() - needed)
        self._leave_room(fillers, needed)
        try:
            return func(*args, **kwargs)
        finally:
            del fillers

    def _leave_room(self, fillers: list, needed: int) -> None:
        """Give fillers back until the results fit in one piece: the bytes free under the cap
        are not all usable (partly used pages of freed tensors stay mapped), and a step that
        ran out of memory here would measure nothing (results/workspace_fillers_before.json)."""
        while True:
            try:
                # freed at once, but cached: the results reuse its room
                torch.empty(needed, dtype=torch.uint8, device=self.device)
                break
            except torch.OutOfMemoryError:
                if not fillers:
                    break                        # the step itself does not fit
                fillers.pop()                    # the smallest, filled last
        self.filled_bytes.append(sum(f.numel() for f in fillers))

    def _fill(self, room: int) -> list:
        fillers, size = [], room
        while room >= _SMALLEST_FILLER and size >= _SMALLEST_FILLER:
            try:
                fillers.append(torch.empty(size, dtype=torch.uint8, device=self.device))
                room -= size
                size = room
            except torch.OutOfMemoryError:           # no hole that large: smaller pieces
                size //= 2
        return fillers
