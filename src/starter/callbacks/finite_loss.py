"""A callback that stops training at the first NaN or infinite loss, naming the step."""

import lightning as L
import torch

from starter.errors import UserError


class StopOnNonFiniteLoss(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is not None and not torch.isfinite(loss).item():
            raise UserError(
                f"the training loss is {loss.item()} at step {trainer.global_step} (epoch {trainer.current_epoch},"
                f" batch {batch_idx}); lower model.optimizer.lr, or check the data for NaN/inf"
            )
