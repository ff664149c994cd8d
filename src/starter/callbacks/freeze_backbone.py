"""`callbacks.freeze_backbone.epochs=N`: fine-tuning trains only the net's head for the first N epochs. Lightning's
BackboneFinetuning takes the backbone out of the optimizer, which no strategy that wraps or shards at setup follows;
here its gradients are dropped before each step of those epochs, so its weights and optimizer state stay, in every mode.
"""

import lightning as L

from starter.models.head import head_name


def freeze_backbone(epochs: int = 0) -> "FreezeBackbone | None":
    """The callback for `epochs` (conf/callbacks/base/every_run.yaml); None when 0 (off)."""
    return FreezeBackbone(int(epochs)) if epochs else None


class FreezeBackbone(L.Callback):
    def __init__(self, epochs: int):
        self.epochs = epochs
        self.backbone: list = []

    def on_fit_start(self, trainer, pl_module) -> None:
        head = f"net.{head_name(pl_module.net)}."
        self.backbone = [p for name, p in pl_module.named_parameters() if not name.startswith(head)]

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.current_epoch < self.epochs:
            for parameter in self.backbone:
                parameter.grad = None
