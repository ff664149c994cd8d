"""Stops training at the first NaN or infinite loss, naming the step, without a host sync per step: each step records
on the device whether its loss is finite; the record is read where the run synchronises anyway (after logging steps,
before a checkpoint is written, so none holds weights a bad loss reached, and at the end of training).
"""

import lightning as L
import torch

from starter.errors import UserError
from starter.models.logging_step import is_logging_step

NONE_YET = 2**62  # the first bad batch's index when there is none (the minimum over ranks is the first)


class StopOnNonFiniteLoss(L.Callback):
    def __init__(self):
        self.on_train_start()

    def on_train_start(self, *args) -> None:
        self.first_bad = self.bad_loss = self.counter = None  # device tensors, made at the first step
        self.positions: list[tuple[int, int, int]] = []  # (step, epoch, batch) of each batch since the last check

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self.positions.append((trainer.global_step, trainer.current_epoch, batch_idx))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not isinstance(loss, torch.Tensor):  # a step that returns no loss (manual optimization may): not watched
            self.positions.pop()
            return
        loss = loss.detach()
        if self.counter is None:
            self.counter = torch.full((), len(self.positions) - 1, dtype=torch.long, device=loss.device)
            self.first_bad = torch.full((), NONE_YET, dtype=torch.long, device=loss.device)
            self.bad_loss = torch.zeros((), dtype=loss.dtype, device=loss.device)
        first = ~torch.isfinite(loss) & (self.first_bad == NONE_YET)
        self.first_bad = torch.where(first, self.counter, self.first_bad)
        self.bad_loss = torch.where(first, loss, self.bad_loss)
        self.counter.add_(1)
        if is_logging_step(trainer):
            self._check(trainer)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._check(trainer)  # raising here writes no checkpoint

    def on_train_end(self, trainer, pl_module) -> None:
        self._check(trainer)

    def _check(self, trainer) -> None:
        if self.counter is None:
            return
        mine = int(self.first_bad)  # the one host sync, at a point that synchronises anyway
        first = int(trainer.strategy.reduce(self.first_bad.clone(), reduce_op="min"))  # the first on any rank
        if first == NONE_YET:
            self.counter.zero_()
            self.positions.clear()
            return
        step, epoch, batch = self.positions[first]
        value = float(self.bad_loss) if mine == first else "not finite"
        raise UserError(
            f"the training loss is {value} at step {step} (epoch {epoch}, batch {batch});"
            " lower model.optimizer.lr, or check the data for NaN/inf"
        )
