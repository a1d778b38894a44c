"""The layer vocabulary of the paper, and how a traced node maps onto it."""

import enum
import operator

import torch
import torch.nn.functional as F
from torch import nn


class Kind(str, enum.Enum):
    """Layer kinds. CONV and FC are expensive (checkpoints); the rest are cheap to recompute."""

    CONV = "CONV"
    FC = "FC"
    POOL = "POOL"
    ACT = "ACT"
    BN = "BN"          # any normalization with batch statistics or affine parameters
    LRN = "LRN"
    DROPOUT = "DROPOUT"
    SOFTMAX = "SOFTMAX"
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
_RANDOM_FUNCTIONS = {F.dropout, F.dropout1d, F.dropout2d, F.alpha_dropout, torch.bernoulli,
                     torch.rand, torch.randn, torch.rand_like, torch.randn_like}


def kind_of(node: torch.fx.Node, module: nn.Module | None) -> Kind:
    if node.op == "call_module":
        for classes, kind in _MODULE_KINDS:
            if isinstance(module, classes):
                return kind
        return Kind.OTHER
    if node.op == "call_function":
        return _FUNCTION_KINDS.get(node.target, Kind.OTHER)
    if node.op == "call_method":
        return _METHOD_KINDS.get(node.target, Kind.OTHER)
    return Kind.OTHER


def is_random(node: torch.fx.Node, module: nn.Module | None, kind: Kind) -> bool:
    """Whether the layer draws random numbers, so a recomputation must replay them."""
    if kind is Kind.DROPOUT:
        return True
    if node.op == "call_function":
        return node.target in _RANDOM_FUNCTIONS
    if node.op == "call_method":
        return node.target in {"bernoulli_", "uniform_", "normal_", "random_", "exponential_"}
    return False
