"""A stop signal (`stop_signals`) ends training on every rank at the same step, with checkpoints/last.ckpt saved where a
resume continues with the next batch; the run exits 143. The handler only records the request; the ranks agree after a
step through one collective (several processes: only at logging steps, between optimizer steps). It replaces
Lightning's handler, which runs a collective inside the signal handler and can deadlock when ranks are signalled at
different points of a step.
"""

import signal
from collections.abc import Sequence
from pathlib import Path

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException

from starter.models.logging_step import is_logging_step


class SaveOnSigterm(L.Callback):
    def __init__(self, dirpath: str, filename: str = "last.ckpt", signals: Sequence[str] = ("SIGTERM",)):
        self.path = Path(dirpath) / filename
        self.signals = [signal.Signals[name] for name in signals]
        self.requested = self.saved = False

    def on_train_start(self, trainer, pl_module) -> None:  # after Lightning registered its handlers
        self.requested = self.saved = False
        for signum in self.signals:
            signal.signal(signum, self._request_stop)

    def _request_stop(self, signum, frame) -> None:
        self.requested = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        if trainer.world_size == 1:
            stop = self.requested  # no collective: under DDP even a world of one would sync the host per step
        elif not is_logging_step(trainer):
            return
        else:
            stop = trainer.strategy.reduce_boolean_decision(self.requested, all=False)
        if stop:
            trainer.save_checkpoint(self.path)
            self.saved = True

    def _stop_if_saved(self, *args, **kwargs) -> None:
        if self.saved:
            raise SIGTERMException()

    on_train_batch_start = on_validation_start = on_train_epoch_end = _stop_if_saved
