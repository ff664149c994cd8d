"""SIGTERM (a scheduler's preemption) ends training cleanly, on every rank at the same step, with last.ckpt saved.

The signal handler only records that a stop was asked. After each training batch, all ranks agree through
one collective (`reduce_boolean_decision`: did any rank get SIGTERM?) and stop together by raising
Lightning's SIGTERMException; on that exception (and no other: after a NaN the weights are what went wrong)
this callback saves checkpoints/last.ckpt, and run.py exits with errors.PREEMPTED_EXIT_CODE (143).
The handler replaces Lightning 2.6's, which runs a collective inside the signal handler itself and can
deadlock when the ranks are signalled at different points of a step.
"""

import signal
from pathlib import Path

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException


class SaveOnSigterm(L.Callback):
    def __init__(self, dirpath: str, filename: str = "last.ckpt"):
        self.path = Path(dirpath) / filename
        self.requested = False

    def on_train_start(self, trainer, pl_module) -> None:  # after Lightning registered its handlers
        self.requested = False
        signal.signal(signal.SIGTERM, self._request_stop)

    def _request_stop(self, signum, frame) -> None:
        self.requested = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.strategy.reduce_boolean_decision(self.requested, all=False):
            raise SIGTERMException()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):
            trainer.save_checkpoint(self.path)
