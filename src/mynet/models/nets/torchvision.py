"""Any torchvision classification model by name, random or with torchvision's weights (`weights: IMAGENET1K_V2`, fetched
into $TORCH_HOME/hub/checkpoints; a file there is used as it is). For another class count the head is replaced, freshly
initialised, and one line says so."""

import logging

from torch import nn

from starter.errors import UserError
from starter.models.head import head_name, replace_head

log = logging.getLogger(__name__)


def torchvision_net(name: str, num_classes: int, in_channels: int = 3, weights: str | None = None) -> nn.Module:
    from torchvision import models

    if weights is None:
        net = models.get_model(name, num_classes=num_classes)
    else:
        try:
            net = models.get_model(name, weights=weights)
        except (OSError, RuntimeError) as err:  # urllib's URLError is an OSError
            url = models.get_model_weights(name)[weights].url
            raise UserError(
                f"model.net.weights={weights}: cannot fetch {url} ({err}); put that file in"
                " $TORCH_HOME/hub/checkpoints (default ~/.cache/torch)"
            ) from None
        head = net.get_submodule(head_name(net))
        if head.out_features != num_classes:
            log.info(
                "%s's %s weights are for %d classes: its head (%s) starts freshly initialised for %d",
                name,
                weights,
                head.out_features,
                head_name(net),
                num_classes,
            )
            replace_head(net, num_classes)
    if in_channels != 3:  # e.g. MNIST's one channel: a first conv layer of its own (a ResNet's conv1)
        if not isinstance(getattr(net, "conv1", None), nn.Conv2d):
            raise UserError(f"{name} takes 3 channels; data.image_shape gives {in_channels}")
        old = net.conv1
        net.conv1 = nn.Conv2d(in_channels, old.out_channels, old.kernel_size, old.stride, old.padding, bias=False)
    return net
