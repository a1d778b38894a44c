"""The networks of the SuperNeurons paper, each ending in LogSoftmax (the paper's SOFTMAX layer).

Train them with ``F.nll_loss(model(x), y)``; ``ZOO`` maps the command line's names to builders
and their usual input size.
"""

from .alexnet import alexnet
from .densenet import densenet
from .inception import inception_v4
from .resnet import resnet
from .vgg import vgg16, vgg19
from .zoo import ZOO, build, input_shape

__all__ = ["alexnet", "vgg16", "vgg19", "resnet", "inception_v4", "densenet", "ZOO", "build",
           "input_shape"]
