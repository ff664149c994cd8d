"""A stop signal (`stop_signals`) ends training on every rank at the same step, one or two optimizer steps after it
arrives, with checkpoints/last.ckpt saved where a resume continues with the next batch; the run exits 143. The handler
only records the request. Several processes agree on the step through the run's store (`StopAgreement`): nothing is
read from the device and no collective is added to a step that does not log, and until a signal arrives such a step
does nothing at all. A logging step's collective decides too where the store cannot (its launcher killed).
It replaces Lightning's handler, which runs a collective inside the signal handler and can deadlock when ranks are
signalled at different points of a step.
"""

import signal
from collections.abc import Sequence
from pathlib import Path

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException

from starter.callbacks.stop_agreement import StopAgreement
from starter.models.logging_step import is_logging_step


class SaveOnSigterm(L.Callback):
    def __init__(self, dirpath: str, filename: str = "last.ckpt", signals: Sequence[str] = ("SIGTERM",)):
        self.path = Path(dirpath) / filename
        self.signals = [signal.Signals[name] for name in signals]
        self.requested = self.saved = False
        self.agreement: StopAgreement | None = None

    def on_train_start(self, trainer, pl_module) -> None:  # after Lightning registered its handlers
        self.requested = self.saved = False
        self.agreement = StopAgreement(trainer.world_size) if trainer.world_size > 1 else None
        for signum in self.signals:
            signal.signal(signum, self._request_stop)

    def _request_stop(self, signum, frame) -> None:
        self.requested = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return  # between optimizer steps the ranks' states differ from a checkpoint's
        if self.agreement is None:
            stop = self.requested
        else:  # every rank gets the same answer: the store's at the agreed step (all of them know), else that of a
            # logging step's collective, where every rank takes part (where the store is gone: its launcher killed)
            stop = self.requested and self.agreement.stop_at(trainer.global_step)
            if not stop and is_logging_step(trainer):
                stop = trainer.strategy.reduce_boolean_decision(self.requested, all=False)
        if stop:
            trainer.save_checkpoint(self.path)  # written and renamed into place on return (checkpointing/)
            self.saved = True
            if self.agreement is not None and trainer.is_global_zero:
                self.agreement.say_saved(trainer.global_step)

    def _stop_if_saved(self, *args, **kwargs) -> None:
        if self.saved:
            raise SIGTERMException()

    on_train_batch_start = on_validation_start = on_train_epoch_end = _stop_if_saved
