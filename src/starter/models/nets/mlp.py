import math

from torch import nn


class MLP(nn.Sequential):
    """Flatten, then Linear-ReLU blocks of the given widths, then a Linear classifier."""

    def __init__(self, in_shape: list[int], num_classes: int, hidden: list[int] = (256, 256)):
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(in_shape)
        for size in hidden:
            layers += [nn.Linear(width, size), nn.ReLU()]
            width = size
        layers.append(nn.Linear(width, num_classes))
        super().__init__(*layers)
