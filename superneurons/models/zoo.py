"""Names the command line knows, mapped to builders and their usual input size."""

from torch import nn

from .alexnet import alexnet
from .densenet import DenseBlock, densenet
from .inception import inception_v4
from .resnet import resnet
from .vgg import vgg16, vgg19

# name -> (builder(depth, growth, num_classes), usual image size in pixels)
ZOO = {
    "alexnet": (lambda depth, growth, classes: alexnet(classes), 224),
    "vgg16": (lambda depth, growth, classes: vgg16(classes), 224),
    "vgg19": (lambda depth, growth, classes: vgg19(classes), 224),
    "resnet50": (lambda depth, growth, classes: resnet(50, num_classes=classes), 224),
    "resnet101": (lambda depth, growth, classes: resnet(101, num_classes=classes), 224),
    "resnet152": (lambda depth, growth, classes: resnet(152, num_classes=classes), 224),
    "resnet": (lambda depth, growth, classes: resnet(depth or 50, num_classes=classes), 224),
    "inception_v4": (lambda depth, growth, classes: inception_v4(classes), 299),
    "densenet121": (lambda depth, growth, classes: densenet(121, growth, num_classes=classes), 224),
    "densenet169": (lambda depth, growth, classes: densenet(169, growth, num_classes=classes), 224),
    "densenet201": (lambda depth, growth, classes: densenet(201, growth, num_classes=classes), 224),
    "densenet264": (lambda depth, growth, classes: densenet(264, growth, num_classes=classes), 224),
    "densenet": (lambda depth, growth, classes: densenet(depth or 121, growth,
                                                         num_classes=classes), 224),
    "densenet_cifar": (lambda depth, growth, classes: densenet(depth or 100, growth, cifar=True,
                                                               num_classes=classes), 32),
}


def build(name: str, *, depth: int | None = None, growth: int | None = None,
          num_classes: int = 1000, efficient: bool = False) -> nn.Module:
    """Build a zoo network by its command-line name; ``efficient``: a DenseNet's shared-storage
    implementation (models/efficient_densenet.py)."""
    if name not in ZOO:
        raise ValueError(f"unknown network {name!r}; choose one of: {', '.join(ZOO)}")
    if name == "densenet_cifar" and num_classes == 1000:
        num_classes = 10
    model = ZOO[name][0](depth, growth, num_classes)
    if efficient:
        if not name.startswith("densenet"):
            raise ValueError(f"efficient applies to the DenseNets (shared storage), not {name!r}")
        for block in model.modules():
            if isinstance(block, DenseBlock):
                block.efficient = True
    return model


def input_shape(name: str, batch: int, image: int | None = None) -> tuple:
    """(batch, 3, px, px) with the network's usual size unless ``image`` is given."""
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    return (batch, 3, image or ZOO[name][1], image or ZOO[name][1])
