"""Small building blocks shared by the zoo."""

from torch import nn


class FlattenLinear(nn.Linear):
    """A fully connected layer that flattens its input first.

    The paper counts the first FC layer as one layer; keeping the flatten inside it keeps the
    route equal to the paper's layer list (AlexNet's 23 layers).
    """

    def forward(self, x):
        return super().forward(x.flatten(1))


def conv_bn_relu(in_channels: int, out_channels: int, kernel_size, stride=1, padding=0) -> list:
    return [nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, bias=False),
            nn.BatchNorm2d(out_channels), nn.ReLU(inplace=True)]
