"""Per epoch: images/s and time of the training steps, the learning rate, and the best `monitor` so far (`val/acc_best`,
also in metrics.json), logged as `train/images_per_s`, `train/epoch_time`, `lr`, `<monitor>_best`. Clocks and counts are
read on the host at batch ends: no device sync, no collective."""

import time

import lightning as L

from starter.errors import UserError

EPOCH_FIGURES = ("train/epoch_time", "train/images_per_s")  # logged once an epoch, at its end


class EpochStats(L.Callback):
    def __init__(self, monitor: str = "val/acc", mode: str = "max"):
        if mode not in ("max", "min"):
            raise UserError(f"monitor_mode={mode}: choose max or min")
        self.monitor, self.better = monitor, max if mode == "max" else min
        self.started = self.ended = 0.0
        self.lr = self.best = None  # floats once known

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.started = self.ended = time.monotonic()
        # the epoch's learning rate (an epoch-wise schedule steps before on_train_epoch_end)
        self.lr = float(trainer.optimizers[0].param_groups[0]["lr"]) if trainer.optimizers else None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.ended = time.monotonic()  # the epoch's time is its training steps': validation is not in it

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        steps = trainer.fit_loop.epoch_loop.batch_progress.current.processed  # this epoch's (after a resume too)
        seconds = max(self.ended - self.started, 1e-9)
        epoch_time, images_per_s = EPOCH_FIGURES
        pl_module.log(epoch_time, seconds)
        pl_module.log(images_per_s, steps * trainer.datamodule.batch_size / seconds)  # the global batch
        if self.lr is not None:
            pl_module.log("lr", self.lr)
        if self.best is not None:  # validation ran before this hook
            pl_module.log(f"{self.monitor}_best", self.best)

    def on_validation_end(self, trainer, pl_module) -> None:  # the epoch's metrics are in callback_metrics by now
        if trainer.sanity_checking:
            return
        if self.monitor not in trainer.callback_metrics:
            logged = ", ".join(sorted(k for k in trainer.callback_metrics if k.startswith("val"))) or "none"
            raise UserError(f"monitor={self.monitor}: the model logs no such metric (its validation metrics: {logged});"
                            " set monitor= and monitor_mode= to one it logs")  # fmt: skip
        value = float(trainer.callback_metrics[self.monitor])
        self.best = value if self.best is None else self.better(self.best, value)

    def state_dict(self) -> dict:
        return {"best": self.best}

    def load_state_dict(self, state_dict: dict) -> None:
        self.best = state_dict.get("best")
