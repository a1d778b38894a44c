from torch import nn

from .layers import FlattenLinear

_STANDARD = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int):
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity  # in place, as torchvision does: the runtime must cope
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, blocks: tuple, num_classes: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                                  nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
        stages, channels = [], 64
        for index, (num_blocks, width) in enumerate(zip(blocks, (64, 128, 256, 512))):
            stage = []
            for block in range(num_blocks):
                stride = 2 if block == 0 and index > 0 else 1
                stage.append(Bottleneck(channels, width, stride))
                channels = width * Bottleneck.expansion
            stages.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), FlattenLinear(channels, num_classes),
                                  nn.LogSoftmax(dim=1))

    def forward(self, x):
        x = self.stem(x)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.head(x)


def resnet_blocks(depth: int) -> tuple:
    """Stage sizes for a bottleneck ResNet: the standard ones, else [3, 4, n, 3]."""
    if depth in _STANDARD:
        return _STANDARD[depth]
    n3, remainder = divmod(depth - 2, 3)
    n3 -= 3 + 4 + 3
    if remainder or n3 < 1:
        nearby = [3 * (3 + 4 + n + 3) + 2 for n in (max(1, n3), max(1, n3) + 1)]
        raise ValueError(f"a bottleneck ResNet has depth 3 * (3 + 4 + n + 3) + 2 with n >= 1; "
                         f"{depth} is not one: try {nearby[0]} or {nearby[1]}")
    return (3, 4, n3, 3)


def resnet(depth: int = 50, *, blocks: tuple | None = None, num_classes: int = 1000) -> ResNet:
    """Bottleneck ResNet (224 px) of any depth; ``blocks`` gives the four stage sizes directly."""
    if blocks is None:
        blocks = resnet_blocks(depth)
    if len(blocks) != 4 or min(blocks) < 1:
        raise ValueError(f"blocks must be four positive stage sizes, got {blocks}")
    return ResNet(tuple(blocks), num_classes)
