"""Small building blocks shared by the zoo."""

import torch
from torch import nn


class FlattenLinear(nn.Linear):
    """A fully connected layer that flattens its input first.

    The paper counts the first FC layer as one layer; keeping the flatten inside it keeps the
    route equal to the paper's layer list (AlexNet's 23 layers).
    """

    def forward(self, x):
        return super().forward(x.flatten(1))


def conv_bn_relu(in_channels: int, out_channels: int, kernel_size, stride=1, padding=0) -> list:
    return [nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, bias=False),
            nn.BatchNorm2d(out_channels), nn.ReLU(inplace=True)]


class LocalResponseNorm(nn.LocalResponseNorm):
    """nn.LocalResponseNorm in one autograd step, a slice of the batch at a time: the same
    function, its backward in under half the memory of PyTorch's own.

    PyTorch builds LRN from seven operations and views, and autograd keeps what each one needs:
    for an input of 1 unit, 3.04 units of saved intermediates and 3 units of temporaries in the
    backward (capture/scratch.py measures them). It then is AlexNet's largest layer, max(l_i),
    and sets the largest batch of every system alike (BENCHMARKS.md, largest batch). This one
    keeps the input and the denominator D = k + alpha * mean of the squares over `size`
    channels, and forms the gradient from them, as cuDNN's fused LRN does:

        dx = g * D^-beta - 2 * alpha * beta * x * mean over the window of (g * x * D^(-beta-1))

    Each sample is normalised on its own, so both directions run over slices of the batch of
    about CHUNK_BYTES, writing into whole outputs: the temporaries are a slice's, and the
    backward holds its gradient, the two saved tensors and the gradient it writes (4 units).
    """

    def forward(self, x):
        return _LocalResponseNorm.apply(x, self.size, self.alpha, self.beta, self.k)


# a slice of 64 MiB still gives each kernel millions of elements, and its temporaries are small
# beside the layer: 0.12 of LRN1's 9.67 GiB l_b in AlexNet at batch 2205 (planner_costs_lrn.json)
CHUNK_BYTES = 64 * 2**20


def _batch_slices(x) -> list:
    per_sample = max(1, x[0].numel() * x.element_size()) if len(x) else 1
    rows = max(1, CHUNK_BYTES // per_sample)
    return [slice(first, first + rows) for first in range(0, len(x), rows)]


def _channel_mean(x, size: int, mirrored: bool = False):
    """Mean over a window of ``size`` channels around each, zeros beyond the edges (as PyTorch's
    LRN pads); any input of three or more dimensions. ``mirrored``: the window the other way
    round, over the channels whose windows hold this one (the gradient's sum)."""
    n, c = x.shape[:2]
    planes = x.reshape(n, 1, c, -1)
    if size % 2:
        mean = nn.functional.avg_pool2d(planes, (size, 1), stride=1, padding=(size // 2, 0))
    else:                                   # an even window is padded unevenly
        before, after = size // 2, (size - 1) // 2
        padded = nn.functional.pad(planes, (0, 0, *((after, before) if mirrored else
                                                      (before, after))))
        mean = nn.functional.avg_pool2d(padded, (size, 1), stride=1)
    return mean.view(x.shape)


class _LocalResponseNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, size, alpha, beta, k):
        if x.dim() < 3:
            raise ValueError(f"LocalResponseNorm needs an input of 3 or more dimensions (batch, "
                             f"channels, ...), got {x.dim()}")
        denominator, out = torch.empty_like(x), torch.empty_like(x)
        for rows in _batch_slices(x):
            part, d = x[rows], denominator[rows]
            d.copy_(_channel_mean(part * part, size)).mul_(alpha).add_(k)
            torch.pow(d, -beta, out=out[rows]).mul_(part)
        ctx.save_for_backward(x, denominator)
        ctx.size, ctx.alpha, ctx.beta = size, alpha, beta
        return out

    @staticmethod
    def backward(ctx, grad):
        x, denominator = ctx.saved_tensors
        grad_x = torch.empty_like(x)
        for rows in _batch_slices(x):
            part, d, g, out = x[rows], denominator[rows], grad[rows], grad_x[rows]
            scale = torch.pow(d, -ctx.beta)
            torch.mul(g, scale, out=out)
            cross = scale.div_(d).mul_(g).mul_(part)        # g * x * D^(-beta-1), in place
            out.addcmul_(part, _channel_mean(cross, ctx.size, mirrored=True),
                         value=-2 * ctx.alpha * ctx.beta)
        return grad_x, None, None, None, None
