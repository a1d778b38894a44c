from torch import nn

from .layers import FlattenLinear

_CONFIGS = {
    16: [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
    19: [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
         512, 512, 512, 512, "M"],
}


def _vgg(config: list, num_classes: int) -> nn.Sequential:
    layers, channels = [], 3
    for width in config:
        if width == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(channels, width, 3, padding=1), nn.ReLU(inplace=True)]
            channels = width
    layers += [nn.AdaptiveAvgPool2d(7),
               FlattenLinear(512 * 7 * 7, 4096), nn.ReLU(inplace=True), nn.Dropout(0.5),
               nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Dropout(0.5),
               nn.Linear(4096, num_classes), nn.LogSoftmax(dim=1)]
    return nn.Sequential(*layers)


def vgg16(num_classes: int = 1000) -> nn.Sequential:
    """VGG-16 (224 px), without batch normalization as in the paper."""
    return _vgg(_CONFIGS[16], num_classes)


def vgg19(num_classes: int = 1000) -> nn.Sequential:
    """VGG-19 (224 px)."""
    return _vgg(_CONFIGS[19], num_classes)
