from torch import nn


class CNN(nn.Sequential):
    """Two conv blocks and a small head; works for any input size (8x8 digits, 28x28 MNIST, 224x224 images)."""

    def __init__(self, in_channels: int, num_classes: int, width: int = 32):
        super().__init__(
            nn.Conv2d(in_channels, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveMaxPool2d(4),
            nn.Flatten(),
            nn.Linear(2 * width * 16, 128),
            nn.ReLU(),
            nn.Linear(128, num_classes),
        )
