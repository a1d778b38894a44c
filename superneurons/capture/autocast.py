"""Autocast on meta tensors: capture sees the dtypes a step under torch.autocast would have.

Capture runs layers on meta tensors, where torch.autocast does not act (it casts only tensors of
its own device type). A step under bf16 autocast would then be planned at fp32 sizes, and the
runtime would replay or offload what a bf16 step never needs (BENCHMARKS.md, speed: ResNet-101
at batch 96 ran at 0.43 of plain PyTorch). This mode replays autocast's casting policy above
autograd, as autocast itself does, so a layer saves the cast copies autocast would save.

Rule 1: only ops that change dtypes under autocast are listed: those run in lower precision,
        those run in float32, and the reductions that autocast gives a float32 dtype when none
        is asked for. Mixed-dtype ops that autocast promotes to the widest type (cat, stack,
        addcmul...) need nothing: PyTorch's own type promotion gives the same result.
Rule 2: the lists are torch's own (aten/src/ATen/autocast_mode.cpp), one per device type, by
        the names under which ops reach __torch_function__; an op missing from them runs in its
        inputs' dtype, as under autocast.
Rule 3: only floating-point tensors other than float64 are cast, as autocast does.
Rule 4: a cross-entropy reaches the mode whole (as F.cross_entropy, or an exported graph's
        aten.cross_entropy_loss), while autocast sees the ops it decomposes into. On the CPU
        autocast lists cross_entropy_loss itself (float32 throughout). CUDA lists no
        cross-entropy: its log-softmax runs in the logits' own dtype (the dtype it is called
        with) and its nll_loss in float32, on a float32 copy of the log-probabilities that the
        loss saves; the mode runs that decomposition, so a plan counts both tensors.
"""

import inspect

import torch.nn.functional as F

import torch
from torch.overrides import TorchFunctionMode

_LOWER = {
    "cuda": {"conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
             "conv_transpose3d", "convolution", "_convolution", "prelu", "addmm", "addmv", "addr",
             "matmul", "__matmul__", "__rmatmul__", "einsum", "mm", "mv", "linalg_vecdot",
             "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
             "multi_dot", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
             "scaled_dot_product_attention"},
    "cpu": {"conv1d", "conv2d", "conv3d", "bmm", "mm", "linalg_vecdot", "baddbmm", "addmm",
            "addbmm", "linear", "_convolution", "matmul", "__matmul__", "__rmatmul__",
            "conv_tbc", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "prelu",
            "scaled_dot_product_attention"},
}
_FLOAT32 = {
    "cuda": {"acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
             "reciprocal", "rsqrt", "sinh", "tan", "pow", "__pow__", "softplus", "layer_norm",
             "group_norm", "nuclear_norm", "cosine_similarity", "poisson_nll_loss",
             "cosine_embedding_loss", "nll_loss", "nll_loss_nd", "nll_loss2d",
             "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss",
             "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
             "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits",
             "dist", "pdist", "cdist", "renorm", "logsumexp", "upsample_nearest1d",
             "upsample_nearest2d", "upsample_nearest3d", "upsample_linear1d",
             "upsample_bilinear2d", "upsample_trilinear3d", "upsample_bicubic2d"},
    "cpu": {"avg_pool3d", "binary_cross_entropy", "grid_sampler", "polar", "prod", "quantile",
            "nanquantile", "stft", "cdist", "trace", "max_pool3d", "adaptive_avg_pool3d",
            "mse_loss", "cosine_embedding_loss", "nll_loss", "nll_loss_nd", "nll_loss2d",
            "hinge_embedding_loss", "poisson_nll_loss", "smooth_l1_loss", "cross_entropy_loss",
            "cross_entropy",                                      # F.cross_entropy: Rule 4
            "l1_loss", "huber_loss", "margin_ranking_loss", "soft_margin_loss",
            "triplet_margin_loss", "multi_margin_loss", "kl_div", "multilabel_margin_loss",
            "binary_cross_entropy_with_logits"},
}
# float32 unless the call names a dtype (autocast's fp32_set_opt_dtype)
_FLOAT32_UNLESS_DTYPE = {
    "cuda": {"prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm",
             "linalg_matrix_norm", "sum", "nansum"},
    "cpu": set(),
}


_CROSS_ENTROPY = ("cross_entropy", "cross_entropy_loss")
_CROSS_ENTROPY_SIGNATURE = inspect.signature(F.cross_entropy)
REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}                        # at::Reduction
_ATEN_DEFAULTS = {"weight": None, "reduction": 1, "ignore_index": -100, "label_smoothing": 0.0}


def casts_cross_entropy(device_type: str) -> bool:
    """Whether autocast on ``device_type`` runs a cross-entropy's input in float32 (Rule 4)."""
    return "cross_entropy_loss" in _FLOAT32.get(device_type, ())


def _cast(obj, dtype: torch.dtype):
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and obj.dtype not in (dtype, torch.float64):   # Rule 3
            return obj.to(dtype)
        return obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast(o, dtype) for o in obj)
    return obj


class AutocastOnMeta(TorchFunctionMode):
    """Within it, ops on meta tensors take the dtypes ``torch.autocast(device_type, dtype)``
    would give them on ``device_type``."""

    def __init__(self, device_type: str, dtype: torch.dtype):
        super().__init__()
        if device_type not in _LOWER:
            raise ValueError(f"superneurons plans autocast on cuda and cpu, not {device_type!r}: "
                             "pass device_type='cuda' or 'cpu', or plan without autocast")
        self.dtype = dtype
        self.lower, self.float32 = _LOWER[device_type], _FLOAT32[device_type]
        self.float32_unless_dtype = _FLOAT32_UNLESS_DTYPE[device_type]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.OpOverload):       # an exported graph's ATen operation
            name = func.overloadpacket.__name__
        else:
            name = getattr(func, "__name__", "")
        if name in _CROSS_ENTROPY and name not in self.float32:            # Rule 4
            return _cross_entropy_below_autocast(func, name, args, kwargs)
        if name in self.lower:
            args, kwargs = _cast(args, self.dtype), {k: _cast(v, self.dtype)
                                                     for k, v in kwargs.items()}
        elif name in self.float32 or (name in self.float32_unless_dtype
                                      and kwargs.get("dtype") is None):
            args, kwargs = _cast(args, torch.float32), {k: _cast(v, torch.float32)
                                                        for k, v in kwargs.items()}
        return func(*args, **kwargs)


def autocast_state(device_type: str):
    """(device type, dtype) of the autocast active on ``device_type`` now, or None."""
    if device_type in _LOWER and torch.is_autocast_enabled(device_type):
        return device_type, torch.get_autocast_dtype(device_type)
    return None


def _cross_entropy_below_autocast(func, name: str, args, kwargs):
    """A cross-entropy of half-precision logits in the dtypes, shapes and saved tensors CUDA's
    autocast gives it (Rule 4), on meta tensors: its values are not the loss's. Other calls as
    they are, except probability targets and the deprecated size_average and reduce, cast
    whole to float32: planned for at least the bytes the step holds."""
    if name == "cross_entropy":
        call = _CROSS_ENTROPY_SIGNATURE.bind(*args, **kwargs)
        call.apply_defaults()
        call = call.arguments
        if call["size_average"] is not None or call["reduce"] is not None or \
                call["reduction"] not in REDUCTIONS:               # torch's own error for these
            return _in_float32(func, args, kwargs)
        call["reduction"] = REDUCTIONS[call["reduction"]]
    else:                                     # aten.cross_entropy_loss's schema, in order
        call = dict(zip(("input", "target"), args[:2]),
                    **dict(zip(_ATEN_DEFAULTS, args[2:])))
        call.update({("input" if k == "self" else k): v for k, v in kwargs.items()})
        call = {**_ATEN_DEFAULTS, **call}
    logits, target = call["input"], call["target"]
    if not (isinstance(logits, torch.Tensor) and logits.dtype in (torch.float16, torch.bfloat16)):
        return func(*args, **kwargs)
    if target.is_floating_point():
        return _in_float32(func, args, kwargs)
    class_dim = 0 if logits.dim() == 1 else 1
    log_probs = torch.log_softmax(logits, class_dim, dtype=logits.dtype)
    loss = torch._C._nn.nll_loss_nd(log_probs.float(), target,
                                    _cast(call["weight"], torch.float32), call["reduction"],
                                    call["ignore_index"])
    smoothing = call["label_smoothing"]
    if smoothing:              # the smoothing term saves nothing more: its shape is the loss's
        weighted = log_probs
        if call["weight"] is not None:    # a float32 temporary of the logits' shape, as on CUDA
            shape = [1] * logits.dim()
            shape[class_dim] = call["weight"].shape[0]
            weighted = log_probs * call["weight"].float().view(shape)
        smooth = -weighted.sum(class_dim, dtype=torch.float32)
        loss = loss * (1 - smoothing) + (smooth.sum() if call["reduction"] else smooth) * smoothing
    return loss


def _in_float32(func, args, kwargs):
    return func(*_cast(args, torch.float32), **{k: _cast(v, torch.float32)
                                                 for k, v in kwargs.items()})
