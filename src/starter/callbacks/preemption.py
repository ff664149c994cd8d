"""A stop signal ends training cleanly, on every rank at the same step, with last.ckpt saved: SIGTERM (a scheduler's
preemption), SIGUSR1 (`sbatch --signal=SIGUSR1@90`: the time limit is near) and SIGUSR2 (a time-out warning), the
`stop_signals` of the config.

The signal handler only records that a stop was asked. After a training step, all ranks agree through one
collective (`reduce_boolean_decision`: did any rank get a stop signal?); if so, checkpoints/last.ckpt is saved there
(the point where Lightning itself saves mid-epoch, so a resume continues with the next batch) and the run
stops at the next hook by raising Lightning's SIGTERMException, after the step has been logged. run.py then
exits with errors.PREEMPTED_EXIT_CODE (143). One process checks after every step (reading a flag costs
nothing); several processes agree only after logging steps, so a step that is not a logging step makes no
collective: a stop then waits at most `trainer.log_every_n_steps` steps. Only between optimizer steps:
gradients half accumulated are in no checkpoint.
The handler replaces Lightning 2.6's, which runs a collective inside the signal handler itself and can
deadlock when the ranks are signalled at different points of a step.
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
