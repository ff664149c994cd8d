import math

from torch import nn


class MLP(nn.Sequential):
    """Flatten, `depth` Linear-ReLU blocks of `width` units (each followed by dropout where `dropout` > 0), then a
    Linear classifier."""

    def __init__(self, in_shape: list[int], num_classes: int, width: int = 256, depth: int = 2, dropout: float = 0.0):
        layers: list[nn.Module] = [nn.Flatten()]
        features = math.prod(in_shape)
        for _ in range(depth):
            layers += [nn.Linear(features, width), nn.ReLU(), *([nn.Dropout(dropout)] if dropout > 0 else [])]
            features = width
        layers.append(nn.Linear(features, num_classes))
        super().__init__(*layers)
