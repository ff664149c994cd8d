"""A classifier net's head: its last Linear layer. Weights trained for another class count leave it as initialised
(fine-tuning), and everything before it is the backbone that fine-tuning may freeze at first."""

from torch import nn

from starter.errors import UserError


def head_name(net: nn.Module) -> str:
    """The name of the net's last Linear layer (a ResNet's fc, torchvision's ViT's heads.head)."""
    names = [name for name, module in net.named_modules() if isinstance(module, nn.Linear)]
    if not names:
        raise UserError(f"{type(net).__name__} has no Linear layer for a classifier head")
    return names[-1]


def replace_head(net: nn.Module, num_classes: int) -> None:
    """A new head of `num_classes` outputs, freshly initialised, in place of the last Linear layer."""
    name = head_name(net)
    old = net.get_submodule(name)
    parent, _, child = name.rpartition(".")
    setattr(net.get_submodule(parent), child, nn.Linear(old.in_features, num_classes, bias=old.bias is not None))
