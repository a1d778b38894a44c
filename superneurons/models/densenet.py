import torch
from torch import nn

from .efficient_densenet import BlockStorage, shared_bottleneck
from .layers import FlattenLinear

_IMAGENET = {121: (6, 12, 24, 16), 169: (6, 12, 32, 32), 201: (6, 12, 48, 32), 264: (6, 12, 64, 48)}


class DenseLayer(nn.Module):
    """BN-ReLU-Conv1x1-BN-ReLU-Conv3x3 on the concatenation of every earlier feature map."""

    def __init__(self, in_channels: int, growth_rate: int, bottleneck: int = 4):
        super().__init__()
        width = bottleneck * growth_rate
        self.norm1, self.relu1 = nn.BatchNorm2d(in_channels), nn.ReLU()
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.norm2, self.relu2 = nn.BatchNorm2d(width), nn.ReLU()
        self.conv2 = nn.Conv2d(width, growth_rate, 3, padding=1, bias=False)

    def forward(self, features: list, storage: BlockStorage | None = None):
        # The concatenation is the memory-hungry part the memory-efficient DenseNet recomputes.
        if storage is not None:
            x = shared_bottleneck(self, storage, features)
        else:
            x = self.conv1(self.relu1(self.norm1(torch.cat(features, 1))))
        return self.conv2(self.relu2(self.norm2(x)))


class DenseBlock(nn.Module):
    """Dense layers on the growing list of features; ``efficient``: through two shared storages
    (efficient_densenet.py)."""

    def __init__(self, num_layers: int, in_channels: int, growth_rate: int,
                 efficient: bool = False):
        super().__init__()
        self.efficient = efficient
        self.max_channels = in_channels + (num_layers - 1) * growth_rate
        self.layers = nn.ModuleList(
            DenseLayer(in_channels + i * growth_rate, growth_rate) for i in range(num_layers))

    def forward(self, x):
        features = [x]
        if not self.efficient:
            for layer in self.layers:
                features.append(layer(features))
            return torch.cat(features, 1)
        storage = BlockStorage(self.max_channels)   # this forward's
        for layer in self.layers:
            features.append(layer(features, storage))
        storage.release()
        return torch.cat(features, 1)


def _transition(in_channels: int, out_channels: int) -> nn.Sequential:
    return nn.Sequential(nn.BatchNorm2d(in_channels), nn.ReLU(),
                         nn.Conv2d(in_channels, out_channels, 1, bias=False), nn.AvgPool2d(2, 2))


class DenseNet(nn.Module):
    def __init__(self, blocks: tuple, growth_rate: int, stem: nn.Module, channels: int,
                 num_classes: int, efficient: bool = False):
        super().__init__()
        stages = []
        for index, num_layers in enumerate(blocks):
            stages.append(DenseBlock(num_layers, channels, growth_rate, efficient))
            channels += num_layers * growth_rate
            if index < len(blocks) - 1:
                stages.append(_transition(channels, channels // 2))
                channels //= 2
        self.stem = stem
        self.blocks = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.BatchNorm2d(channels), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                  FlattenLinear(channels, num_classes), nn.LogSoftmax(dim=1))

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


def densenet_blocks(depth: int, cifar: bool) -> tuple:
    """Layers per dense block: ImageNet 121/169/201/264 or [6, 12, n, 16]; CIFAR 3 x (depth-4)/6."""
    if cifar:
        n, remainder = divmod(depth - 4, 6)
        if remainder or n < 1:
            raise ValueError(f"a CIFAR DenseNet-BC has depth 6n + 4 with n >= 1; {depth} is not: "
                             f"try {6 * max(1, n) + 4}")
        return (n, n, n)
    if depth in _IMAGENET:
        return _IMAGENET[depth]
    n3, remainder = divmod(depth - 5, 2)
    n3 -= 6 + 12 + 16
    if remainder or n3 < 1:
        raise ValueError(f"an ImageNet DenseNet-BC has depth 2 * (6 + 12 + n + 16) + 5 with n >= 1 "
                         f"(121, 169, 201, 264 are standard); {depth} is not one: try "
                         f"{2 * (34 + max(1, n3)) + 5}")
    return (6, 12, n3, 16)


def densenet(depth: int = 121, growth_rate: int | None = None, *, cifar: bool = False,
             num_classes: int | None = None, efficient: bool = False) -> DenseNet:
    """DenseNet-BC: ImageNet (224 px, k=32 by default) or the 3-block CIFAR variant (32 px, k=12).
    ``efficient``: the memory-efficient implementation (shared storage for every dense layer's
    concatenation and normalization, recomputed in backward; efficient_densenet.py), with the
    same parameters, buffers and results."""
    blocks = densenet_blocks(depth, cifar)
    if cifar:
        growth_rate = growth_rate or 12
        channels = 2 * growth_rate
        stem = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        return DenseNet(blocks, growth_rate, stem, channels, num_classes or 10, efficient)
    growth_rate = growth_rate or 32
    channels = 2 * growth_rate
    stem = nn.Sequential(nn.Conv2d(3, channels, 7, 2, 3, bias=False), nn.BatchNorm2d(channels),
                         nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
    return DenseNet(blocks, growth_rate, stem, channels, num_classes or 1000, efficient)
