from torch import nn

from .layers import FlattenLinear, LocalResponseNorm


def alexnet(num_classes: int = 1000) -> nn.Sequential:
    """The paper's 23-layer AlexNet (224 px): CONV1 RELU1 LRN1 POOL1 ... FC3 SOFTMAX. Its LRN is
    layers.LocalResponseNorm, one autograd step as the paper's cuDNN LRN is: PyTorch's own makes
    LRN1 the largest layer of every system at a third more memory."""
    return nn.Sequential(
        nn.Conv2d(3, 96, 11, stride=4, padding=2), nn.ReLU(inplace=True),
        LocalResponseNorm(5), nn.MaxPool2d(3, 2),
        nn.Conv2d(96, 256, 5, padding=2), nn.ReLU(inplace=True),
        LocalResponseNorm(5), nn.MaxPool2d(3, 2),
        nn.Conv2d(256, 384, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(384, 384, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
        FlattenLinear(256 * 6 * 6, 4096), nn.ReLU(inplace=True), nn.Dropout(0.5),
        nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Dropout(0.5),
        nn.Linear(4096, num_classes), nn.LogSoftmax(dim=1),
    )
