"""The progress display: on a terminal Lightning's tqdm bar, redrawn at most every `refresh_s` seconds; elsewhere (a
SLURM log, a pipe) one line per epoch. Neither reads the device outside logging steps: the training values shown are the
last logging step's."""

import sys
import time

from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar

from starter.callbacks.epoch_stats import EPOCH_FIGURES
from starter.models.logging_step import is_logging_step


def progress_bar(enabled: bool = True, refresh_s: float = 0.25) -> ProgressBar | None:
    """A bar on a terminal, else lines; None when disabled (Lightning refuses a progress bar callback then)."""
    if not enabled:
        return None
    return TimedBar(refresh_s) if sys.stdout.isatty() else EpochLines()


def logged_training_values(trainer) -> tuple[int, dict[str, float]] | None:
    """At a logging step, (optimizer steps done, the module's `train/...` values but the epoch's figures); else None."""
    if not is_logging_step(trainer):
        return None
    metrics = trainer.callback_metrics.items()
    return trainer.global_step, {k: float(v) for k, v in metrics if k.startswith("train/") and k not in EPOCH_FIGURES}


class TimedBar(TQDMProgressBar):
    def __init__(self, refresh_s: float = 0.25):
        super().__init__(refresh_rate=1)
        self.refresh_s, self.last_drawn, self.training = refresh_s, 0.0, (0, {})

    def _due(self, batch_idx: int, total) -> bool:
        now = time.monotonic()
        if now - self.last_drawn < self.refresh_s and batch_idx + 1 != total:
            return False
        self.last_drawn = now
        return True

    def get_metrics(self, trainer, pl_module) -> dict:
        return {**self.training[1], **super().get_metrics(trainer, pl_module)}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.training = logged_training_values(trainer) or self.training
        if self._due(batch_idx, self.train_progress_bar.total):  # one frame: the count and the figures together
            self.train_progress_bar.n = batch_idx + 1
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self._due(batch_idx, self.val_progress_bar.total):
            super().on_validation_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self._due(batch_idx, self.test_progress_bar.total):
            super().on_test_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)


class EpochLines(ProgressBar):
    """`epoch 3/20: 19 steps in 1.2 s; at step 57: train/loss 0.312; val/acc 0.952, val/loss 0.171`, printed by rank 0:
    the training figures of the epoch's last logging step (one batch of one rank), the validation's of the epoch."""

    def __init__(self):
        super().__init__()
        self.enabled, self.started, self.training = True, 0.0, (0, {})

    def disable(self) -> None:
        self.enabled = False

    def enable(self) -> None:
        self.enabled = True

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.started, self.first_step = time.monotonic(), trainer.global_step

    on_train_start = on_train_epoch_start  # a run resumed mid-epoch starts there: Lightning calls no epoch start

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.training = logged_training_values(trainer) or self.training

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if not self.enabled:
            return
        epochs = f"/{trainer.max_epochs}" if trainer.max_epochs and trainer.max_epochs > 0 else ""
        parts = [
            f"epoch {trainer.current_epoch + 1}{epochs}: {trainer.global_step - self.first_step} steps in"
            f" {time.monotonic() - self.started:.1f} s"
        ]
        step, training = self.training
        # each figure once: the epoch's where the module logs one for the bar (a value logged on_epoch only is last
        # epoch's at this epoch's logging steps)
        training = {k: v for k, v in training.items() if k not in trainer.progress_bar_metrics}
        if training:
            parts.append(f"at step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in sorted(training.items())))
        if trainer.progress_bar_metrics:
            parts.append(", ".join(f"{k} {v:.4g}" for k, v in sorted(trainer.progress_bar_metrics.items())))
        print("; ".join(parts), flush=True)
