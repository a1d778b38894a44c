"""Inception-v4 (Szegedy et al. 2016), 299 px: a network of fans, each joined by a concatenation."""

import torch
from torch import nn

from .layers import FlattenLinear, conv_bn_relu


def _conv(cin, cout, kernel, stride=1, padding=0) -> nn.Sequential:
    return nn.Sequential(*conv_bn_relu(cin, cout, kernel, stride, padding))


def _chain(cin: int, *specs) -> nn.Sequential:
    """Convolutions in a row: each spec is (channels, kernel[, stride[, padding]])."""
    layers = []
    for spec in specs:
        layers.append(_conv(cin, *spec))
        cin = spec[0]
    return nn.Sequential(*layers)


class Fan(nn.Module):
    """Branches that all read the same input, joined by concatenation along channels."""

    def __init__(self, *branches: nn.Module):
        super().__init__()
        self.branches = nn.ModuleList(branches)

    def forward(self, x):
        return torch.cat([branch(x) for branch in self.branches], 1)


class SplitTail(nn.Module):
    """Inception-C's branch that ends by forking into a 1x3 and a 3x1 convolution."""

    def __init__(self, trunk: nn.Module, cin: int):
        super().__init__()
        self.trunk = trunk
        self.left, self.right = _conv(cin, 256, (1, 3), 1, (0, 1)), _conv(cin, 256, (3, 1), 1, (1, 0))

    def forward(self, x):
        x = self.trunk(x)
        return torch.cat([self.left(x), self.right(x)], 1)


def _pool_branch(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.AvgPool2d(3, 1, 1, count_include_pad=False), _conv(cin, cout, 1))


def _inception_a() -> Fan:
    return Fan(_pool_branch(384, 96), _conv(384, 96, 1), _chain(384, (64, 1), (96, 3, 1, 1)),
               _chain(384, (64, 1), (96, 3, 1, 1), (96, 3, 1, 1)))


def _inception_b() -> Fan:
    return Fan(_pool_branch(1024, 128), _conv(1024, 384, 1),
               _chain(1024, (192, 1), (224, (1, 7), 1, (0, 3)), (256, (7, 1), 1, (3, 0))),
               _chain(1024, (192, 1), (192, (1, 7), 1, (0, 3)), (224, (7, 1), 1, (3, 0)),
                      (224, (1, 7), 1, (0, 3)), (256, (7, 1), 1, (3, 0))))


def _inception_c() -> Fan:
    return Fan(_pool_branch(1536, 256), _conv(1536, 256, 1),
               SplitTail(_conv(1536, 384, 1), 384),
               SplitTail(_chain(1536, (384, 1), (448, (3, 1), 1, (1, 0)), (512, (1, 3), 1, (0, 1))),
                         512))


def inception_v4(num_classes: int = 1000) -> nn.Sequential:
    """Inception-v4 for 299 px images."""
    stem = [
        _chain(3, (32, 3, 2), (32, 3), (64, 3, 1, 1)),
        Fan(nn.MaxPool2d(3, 2), _conv(64, 96, 3, 2)),
        Fan(_chain(160, (64, 1), (96, 3)),
            _chain(160, (64, 1), (64, (7, 1), 1, (3, 0)), (64, (1, 7), 1, (0, 3)), (96, 3))),
        Fan(_conv(192, 192, 3, 2), nn.MaxPool2d(3, 2)),
    ]
    reduction_a = Fan(nn.MaxPool2d(3, 2), _conv(384, 384, 3, 2),
                      _chain(384, (192, 1), (224, 3, 1, 1), (256, 3, 2)))
    reduction_b = Fan(nn.MaxPool2d(3, 2), _chain(1024, (192, 1), (192, 3, 2)),
                      _chain(1024, (256, 1), (256, (1, 7), 1, (0, 3)), (320, (7, 1), 1, (3, 0)),
                             (320, 3, 2)))
    return nn.Sequential(
        *stem, *[_inception_a() for _ in range(4)], reduction_a,
        *[_inception_b() for _ in range(7)], reduction_b, *[_inception_c() for _ in range(3)],
        nn.AdaptiveAvgPool2d(1), nn.Dropout(0.2), FlattenLinear(1536, num_classes),
        nn.LogSoftmax(dim=1))
