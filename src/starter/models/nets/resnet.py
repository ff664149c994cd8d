from torch import nn


class ResNet(nn.Module):
    """torchvision's ResNet (randomly initialised), with conv1 taking `in_channels` channels."""

    def __init__(self, depth: int, num_classes: int, in_channels: int = 3):
        super().__init__()
        from torchvision.models import resnet

        depths = {18: resnet.resnet18, 34: resnet.resnet34, 50: resnet.resnet50, 101: resnet.resnet101}
        if depth not in depths:
            raise ValueError(f"ResNet depth {depth}: choose one of {sorted(depths)}")
        self.model = depths[depth](num_classes=num_classes)
        if in_channels != 3:
            self.model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)

    def forward(self, images):
        return self.model(images)
