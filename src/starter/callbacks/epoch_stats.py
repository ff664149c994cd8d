"""Per epoch: images/s and time of the training steps, the learning rate, and the best `monitor` so far (`val/acc_best`,
also in metrics.json), logged as `train/images_per_s`, `train/epoch_time`, `lr`, `<monitor>_best`. Clocks and counts are
read on the host at batch ends: no device sync, no collective. Samples are counted off the batches trained (their
first tensor's length, times the data-parallel processes), whatever the DataModule; a task that logs no `monitor` gets
no `<monitor>_best` (checkpointing/best.py says so once)."""

import time

from starter.callbacks.restored import Restored
from starter.errors import UserError
from starter.topology import data_parallel_place

EPOCH_FIGURES = ("train/epoch_time", "train/images_per_s")  # logged once an epoch, at its end


class EpochStats(Restored):
    def __init__(self, monitor: str = "val/acc", mode: str = "max"):
        if mode not in ("max", "min"):
            raise UserError(f"monitor_mode={mode}: choose max or min")
        self.monitor, self.better = monitor, max if mode == "max" else min
        self.started = self.ended = 0.0
        self.samples = 0  # this process's, this epoch
        self.lr = self.best = None  # floats once known

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.started = self.ended = time.monotonic()
        self.samples = 0
        # the epoch's learning rate (an epoch-wise schedule steps before on_train_epoch_end)
        self.lr = float(trainer.optimizers[0].param_groups[0]["lr"]) if trainer.optimizers else None

    on_train_start = on_train_epoch_start  # a run resumed mid-epoch starts there: Lightning calls no epoch start

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.ended = time.monotonic()  # the epoch's time is its training steps': validation is not in it
        self.samples += batch_length(batch)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        seconds = max(self.ended - self.started, 1e-9)
        epoch_time, images_per_s = EPOCH_FIGURES
        pl_module.log(epoch_time, seconds)
        # every data-parallel process trains as many samples (a tensor-parallel group or a pipeline shares them)
        pl_module.log(images_per_s, self.samples * data_parallel_place(trainer)[0] / seconds)
        if self.lr is not None:
            pl_module.log("lr", self.lr)
        if self.best is not None:  # validation ran before this hook
            pl_module.log(f"{self.monitor}_best", self.best)

    def on_validation_end(self, trainer, pl_module) -> None:  # the epoch's metrics are in callback_metrics by now
        if trainer.sanity_checking:
            return
        if self.monitor not in trainer.callback_metrics:
            return
        value = float(trainer.callback_metrics[self.monitor])
        self.best = value if self.best is None else self.better(self.best, value)

    def state_dict(self) -> dict:
        return {"best": self.best}

    def load_state_dict(self, state_dict: dict) -> None:
        with self.reading():
            self.best = None if state_dict.get("best") is None else float(state_dict["best"])


def batch_length(batch) -> int:
    """The samples in a batch: the length of its first tensor (in a tuple, list or dict, at any depth); 0 if none."""
    if hasattr(batch, "shape"):
        return int(batch.shape[0]) if len(batch.shape) else 0
    parts = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    return next((n for n in map(batch_length, parts) if n), 0)
