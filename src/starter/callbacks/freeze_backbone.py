"""`callbacks.freeze_backbone.epochs=N`: fine-tuning trains only the net's head for the first N epochs, then all of it.

Lightning's BackboneFinetuning takes the backbone out of the optimizer and adds it back later, which no strategy
that wraps or shards the module at setup follows: DDP registers only the parameters that required gradients then
(the backbone's gradients would never be averaged once unfrozen: replicas drift apart), FSDP and tensor parallel
hold the parameters as shards. Here every parameter stays where the strategy put it and in the optimizer: the
backbone's gradients are dropped before each optimizer step of the frozen epochs, so its weights and its optimizer
state do not move (no weight decay either), in every mode. The backward still computes them (no time saved)."""

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
