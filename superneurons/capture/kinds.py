"""The layer vocabulary of the paper, and how a traced node maps onto it."""

import enum
import math
import operator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree


class Kind(str, enum.Enum):
    """Layer kinds. CONV, FC and ATTN are expensive (checkpoints); the rest are cheap to recompute."""

    CONV = "CONV"
    FC = "FC"
    POOL = "POOL"
    ACT = "ACT"
    BN = "BN"          # any normalization with batch statistics or affine parameters
    LRN = "LRN"
    DROPOUT = "DROPOUT"
    SOFTMAX = "SOFTMAX"
    ATTN = "ATTN"      # attention: two matrix products per head
    JOIN = "JOIN"      # element-wise add of branches (ResNet)
    CONCAT = "CONCAT"  # concatenation of branches (Inception, DenseNet)
    OTHER = "OTHER"    # flatten, reshape, getitem and the rest

    def __str__(self) -> str:
        return self.value


_MODULE_KINDS = [
    ((nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
      nn.ConvTranspose3d), Kind.CONV),
    ((nn.Linear, nn.Bilinear), Kind.FC),
    ((nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
      nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool2d),
     Kind.POOL),
    ((nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.ELU, nn.Hardswish,
      nn.Mish, nn.PReLU, nn.Softplus, nn.Hardtanh), Kind.ACT),
    ((nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm), Kind.BN),
    ((nn.LocalResponseNorm,), Kind.LRN),
    ((nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout), Kind.DROPOUT),
    ((nn.Softmax, nn.LogSoftmax), Kind.SOFTMAX),
]

_FUNCTION_KINDS = {
    operator.add: Kind.JOIN, operator.iadd: Kind.JOIN, torch.add: Kind.JOIN,
    torch.cat: Kind.CONCAT, torch.concat: Kind.CONCAT,
    F.relu: Kind.ACT, torch.relu: Kind.ACT, torch.relu_: Kind.ACT, F.gelu: Kind.ACT,
    F.silu: Kind.ACT, torch.sigmoid: Kind.ACT, torch.tanh: Kind.ACT,
    F.conv1d: Kind.CONV, F.conv2d: Kind.CONV, F.conv3d: Kind.CONV, F.linear: Kind.FC,
    F.max_pool2d: Kind.POOL, F.avg_pool2d: Kind.POOL, F.adaptive_avg_pool2d: Kind.POOL,
    F.batch_norm: Kind.BN, F.layer_norm: Kind.BN, F.dropout: Kind.DROPOUT,
    F.softmax: Kind.SOFTMAX, F.log_softmax: Kind.SOFTMAX,
}
_METHOD_KINDS = {"add": Kind.JOIN, "add_": Kind.JOIN, "__iadd__": Kind.JOIN, "relu": Kind.ACT,
                 "relu_": Kind.ACT, "sigmoid": Kind.ACT, "softmax": Kind.SOFTMAX,
                 "log_softmax": Kind.SOFTMAX}
# ATen operations (graphs captured by torch.export) by the name of their overload packet
_ATEN_KINDS = {
    **dict.fromkeys(("conv1d", "conv2d", "conv3d", "convolution", "conv_transpose1d",
                     "conv_transpose2d", "conv_transpose3d", "_convolution"), Kind.CONV),
    **dict.fromkeys(("linear", "addmm", "mm", "bmm", "matmul", "baddbmm", "einsum",
                     "bilinear"), Kind.FC),
    **dict.fromkeys(("scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                     "_scaled_dot_product_efficient_attention",
                     "_scaled_dot_product_cudnn_attention"), Kind.ATTN),
    **dict.fromkeys(("max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d",
                     "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
                     "adaptive_avg_pool3d", "adaptive_max_pool2d", "max_pool2d_with_indices"),
                    Kind.POOL),
    **dict.fromkeys(("relu", "relu_", "relu6", "gelu", "gelu_", "silu", "silu_", "sigmoid",
                     "sigmoid_", "tanh", "tanh_", "hardswish", "hardswish_", "hardsigmoid",
                     "hardsigmoid_", "leaky_relu", "leaky_relu_", "elu", "elu_", "mish",
                     "softplus", "hardtanh", "hardtanh_", "prelu"), Kind.ACT),
    **dict.fromkeys(("batch_norm", "layer_norm", "group_norm", "rms_norm", "instance_norm",
                     "native_batch_norm", "native_layer_norm"), Kind.BN),
    **dict.fromkeys(("dropout", "dropout_", "feature_dropout", "alpha_dropout",
                     "native_dropout"), Kind.DROPOUT),
    **dict.fromkeys(("softmax", "_softmax", "log_softmax", "_log_softmax"), Kind.SOFTMAX),
    **dict.fromkeys(("add", "add_"), Kind.JOIN),
    **dict.fromkeys(("cat", "concat"), Kind.CONCAT),
}


def kind_of(node: torch.fx.Node, module: nn.Module | None) -> Kind:
    if node.op == "call_module":
        for classes, kind in _MODULE_KINDS:
            if isinstance(module, classes):
                return kind
        return Kind.OTHER
    if node.op == "call_function":
        if isinstance(node.target, torch._ops.OpOverload):
            return _ATEN_KINDS.get(node.target.overloadpacket.__name__, Kind.OTHER)
        return _FUNCTION_KINDS.get(node.target, Kind.OTHER)
    if node.op == "call_method":
        return _METHOD_KINDS.get(node.target, Kind.OTHER)
    return Kind.OTHER


def flops_of(kind: Kind, node: torch.fx.Node, module, args, outputs: list) -> int:
    """Multiply-adds x 2 of a convolution, matrix product or attention (0 for the rest), from
    the shapes the layer ran with: what replaying it costs in arithmetic."""
    if kind not in (Kind.CONV, Kind.FC, Kind.ATTN) or not outputs:
        return 0
    out = outputs[0]
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor):                      # a torch.nn module
        return 2 * out.numel() * math.prod(weight.shape[1:])
    tensors = [a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]
    if kind is Kind.CONV and len(tensors) >= 2:
        return 2 * out.numel() * math.prod(tensors[1].shape[1:])
    if kind is Kind.ATTN and len(tensors) >= 3:             # QK^T and PV: 2 x (L x S x E)
        query, key = tensors[0], tensors[1]
        return 4 * query.numel() * key.shape[-2]
    if kind is Kind.FC and tensors:                # reduce over the left operand's last dim
        packet = getattr(node.target, "overloadpacket", None)
        left = tensors[1] if packet in (torch.ops.aten.addmm, torch.ops.aten.baddbmm) \
            and len(tensors) > 1 else tensors[0]
        return 2 * out.numel() * left.shape[-1] if left.dim() else 0
    return 0
