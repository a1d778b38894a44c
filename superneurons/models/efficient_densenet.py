"""The memory-efficient DenseNet (Pleiss et al. 2017, papers/003): shared storage for the
concatenation and batch normalization that start every dense layer, recomputed in backward.

A plain dense layer keeps its concatenation of all earlier features and that concatenation
normalized and rectified until backward: two tensors per layer, each as wide as the layer's
input, so memory grows with the square of the depth. Here each dense block owns two shared
storages, sized once for its widest layer (the last):

- forward: every layer concatenates into the first and normalizes into the second, which its
  1x1 convolution reads; the next layer overwrites both. Nothing of them is saved for backward:
  autograd keeps only the features themselves (which the block's output needs anyway), the
  parameters and the bottleneck convolution's output, which has a fixed width;
- backward: each layer concatenates its features again, runs the normalization and ReLU again
  (not the 1x1 convolution: its backward needs only its input) and the three backwards from
  there. These are PyTorch's own autograd kernels on the same values, so the gradients are
  plain PyTorch's bit for bit. Its buffers (the concatenation, the normalized input, the
  gradients, each as wide as the concatenation) are its own and freed before the next layer's
  backward starts, so the caching allocator hands that layer the same blocks: the shared
  storage, and the paper's shared gradient storage, of backward (a storage shared explicitly
  would break where backwards run concurrently on a retained graph or leave a layer out).
  Running statistics move once, in forward; a gradient of the gradient is refused.

The normalization writes into the shared storage where PyTorch's own kernel for it has an
``out=`` form and gives plain PyTorch's bits (its native kernel on the CPU); on CUDA plain
PyTorch runs cuDNN's kernel, which always allocates, and there the output is a temporary, freed
before the next layer's.
Under autocast and on channels_last features the plain layer runs (shared_bottleneck says why).

Under ``sn.wrap`` the layers are captured as plain ones (torch.fx traces the plain forward):
the planner's recomputation segments then do what the shared storages do, and its plan counts
every one of those bytes, which storages hidden inside a layer would keep from it.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import _symbolic_trace


class SharedStorage:
    """One flat tensor that every layer of a dense block writes in turn; allocated at the first
    use (the device and dtype are known then) for the block's widest layer, so it never grows."""

    def __init__(self, max_channels: int):
        self.max_channels = max_channels
        self.flat = None

    def view(self, like: torch.Tensor, channels: int) -> torch.Tensor:
        n, _, *spatial = like.shape
        shape = (n, channels, *spatial)
        needed = n * self.max_channels * math.prod(spatial)
        flat = self.flat
        if flat is None or flat.numel() < needed or flat.device != like.device or \
                flat.dtype != like.dtype:
            flat = self.flat = torch.empty(needed, dtype=like.dtype, device=like.device)
        return flat[:math.prod(shape)].view(shape)

    def release(self) -> None:
        self.flat = None


class BlockStorage:
    """A dense block's two shared storages for one forward."""

    def __init__(self, max_channels: int):
        self.concat = SharedStorage(max_channels)
        self.normed = SharedStorage(max_channels)

    def release(self) -> None:
        self.concat.release()
        self.normed.release()


def _norm_writes_in_place(x: torch.Tensor) -> bool:
    """Whether the normalization writes into the shared storage: where plain PyTorch runs the
    native kernel, which has an out= form, and that was seen to give its bits: the CPU. On CUDA
    plain PyTorch mostly runs cuDNN's kernel (no out= form) and picks the native one by rules
    of dtype, size and epsilon; F.batch_norm there makes the same pick by construction."""
    return x.device.type == "cpu"


def _update_factor(norm: nn.BatchNorm2d) -> float:
    """nn.BatchNorm2d's forward before its kernel: count the batch, give the update's factor."""
    factor = 0.0 if norm.momentum is None else norm.momentum
    if norm.training and norm.track_running_stats and norm.num_batches_tracked is not None:
        norm.num_batches_tracked.add_(1)
        factor = 1.0 / float(norm.num_batches_tracked) if norm.momentum is None else norm.momentum
    return factor


class _SharedBottleneck(torch.autograd.Function):
    """concat -> norm1 -> relu1 -> conv1 of one dense layer, through the block's storages in
    forward."""

    @staticmethod
    def forward(ctx, layer, storage, count, *tensors):
        features, (norm_weight, norm_bias, conv_weight) = tensors[:count], tensors[count:]
        norm, conv = layer.norm1, layer.conv1
        channels = sum(f.shape[1] for f in features)
        concat = storage.concat.view(features[0], channels)
        torch.cat(features, 1, out=concat)
        factor = _update_factor(norm)
        stats = (norm.running_mean, norm.running_var) if norm.track_running_stats else (None,
                                                                                        None)
        training = norm.training or stats[0] is None
        if _norm_writes_in_place(concat):
            normed = storage.normed.view(concat, channels)
            save = torch.empty(0, device=concat.device, dtype=concat.dtype)
            torch.ops.aten.native_batch_norm.out(concat, norm_weight, norm_bias, *stats, training,
                                                 factor, norm.eps, out=normed, save_mean=save,
                                                 save_invstd=save.clone())
        else:
            normed = F.batch_norm(concat, *stats, norm_weight, norm_bias, training, factor,
                                  norm.eps)
        output = conv._conv_forward(normed.relu_(), conv_weight, conv.bias)
        ctx.layer, ctx.count, ctx.training = layer, count, training
        ctx.eval_stats = None if training else tuple(s.clone() for s in stats)
        ctx.save_for_backward(*features, norm_weight, norm_bias, conv_weight)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        # create_graph=True: the recomputation below is not differentiated, so a gradient of
        # this gradient would silently miss terms (once_differentiable raises only where a
        # later backward happens to pass through it, and torch.autograd.grad may not)
        if torch.is_grad_enabled() and grad_output.requires_grad:
            raise ValueError("the shared-storage DenseNet (efficient=True) takes no gradient of "
                             "a gradient (create_graph=True): use the plain DenseNet for that")
        with torch.no_grad():
            return _SharedBottleneck._backward(ctx, grad_output)

    @staticmethod
    def _backward(ctx, grad_output):
        saved = ctx.saved_tensors
        features, parameters = saved[:ctx.count], saved[ctx.count:]
        norm, conv = ctx.layer.norm1, ctx.layer.conv1
        # a buffer of this backward's own, freed when it returns: the caching allocator hands
        # its block to the next layer's backward (backwards may also run concurrently on a
        # retained graph, or leave a block's first layer out)
        concat = torch.cat(features, 1)
        needs = ctx.needs_input_grad[3:]
        with torch.enable_grad():
            leaf = concat.detach().requires_grad_()
            weight, bias = (p.detach().requires_grad_(p.requires_grad) for p in parameters[:2])
            stats = ctx.eval_stats or (None, None)
            normed = F.batch_norm(leaf, *stats, weight, bias, ctx.training, 0.0, norm.eps)
            rectified = F.relu(normed)
        # the 1x1 convolution is not run again: its backward needs only its input, and
        # convolution_backward is the kernel autograd calls for it
        grad_rectified, grad_conv_weight, _ = torch.ops.aten.convolution_backward(
            grad_output, rectified, parameters[2], None, conv.stride, conv.padding,
            conv.dilation, False, [0] * len(conv.stride), conv.groups,
            [True, needs[ctx.count + 2], False])
        inputs = ([leaf] if any(needs[:ctx.count]) else []) + [
            t for t, needed in zip((weight, bias), needs[ctx.count:]) if needed]
        grads = dict(zip(map(id, inputs), torch.autograd.grad(rectified, inputs, grad_rectified)
                         if inputs else ()))
        result, offset = [], 0
        for feature, needed in zip(features, needs):
            width = feature.shape[1]     # plain cat's backward hands out views as well
            result.append(grads[id(leaf)].narrow(1, offset, width) if needed else None)
            offset += width
        result += [grads.get(id(weight)), grads.get(id(bias)), grad_conv_weight]
        return (None, None, None, *result)


def _capturing() -> bool:
    """Whether torch.fx, torch.export or torch.compile is tracing the forward: they capture the
    plain layer (an opaque function holding storages would hide its bytes from the plan)."""
    symbolic = getattr(_symbolic_trace, "is_fx_symbolic_tracing", _symbolic_trace.is_fx_tracing)
    exporting = getattr(torch.compiler, "is_exporting", lambda: False)
    return symbolic() or torch.compiler.is_compiling() or exporting()


def _plain_modules(layer) -> bool:
    """Whether the layer's first three modules are exactly what the Function computes: torch.nn's
    own classes as the DenseNet builds them, with no hooks (a subclass such as SyncBatchNorm, a
    pruning pre-hook or a forward hook changes what they do, and the Function calls none)."""
    norm, relu, conv = layer.norm1, layer.relu1, layer.conv1
    modules = (norm, relu, conv)
    hooked = any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or
                 m._backward_pre_hooks for m in modules) or any(
        getattr(torch.nn.modules.module, name)
        for name in ("_global_forward_hooks", "_global_forward_pre_hooks",
                     "_global_backward_hooks", "_global_backward_pre_hooks"))
    return (type(norm) is nn.BatchNorm2d and type(relu) is nn.ReLU and type(conv) is nn.Conv2d
            and norm.affine and not relu.inplace and conv.bias is None
            and conv.padding_mode == "zeros" and not hooked)


def shared_bottleneck(layer, storage: BlockStorage, features: list) -> torch.Tensor:
    """conv1(relu1(norm1(cat(features)))) of ``layer`` through ``storage`` (see the module's
    docstring). The plain computation without grad, where nothing is kept anyway; under
    autocast, whose casts a recomputation in backward would have to repeat; and on
    channels_last features, whose concatenation is channels_last too (kernels chosen by layout
    would differ from plain PyTorch's on the storages' contiguous views)."""
    if not torch.is_grad_enabled() or storage is None or _capturing() or \
            torch.is_autocast_enabled(features[0].device.type) or \
            not all(f.is_contiguous() for f in features) or not _plain_modules(layer):
        return layer.conv1(layer.relu1(layer.norm1(torch.cat(features, 1))))
    norm = layer.norm1
    return _SharedBottleneck.apply(layer, storage, len(features), *features, norm.weight,
                                   norm.bias, layer.conv1.weight)
