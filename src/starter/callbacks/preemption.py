"""A stop signal (`stop_signals`) ends the run at any phase with exit 143 and one line saying what was saved
(stop_agreement.stop_line). While training steps, every rank stops at the same step, one or two optimizer steps after it
arrives, with checkpoints/last.ckpt saved where a resume continues with the next batch. Before that (setup, the
sanity check) and after (the final save, the test) it stops where it is: nothing new to save. The handler only
records the request. Several processes agree on the step through the run's store (`StopAgreement`): nothing is read
from the device and no collective is added to a step that does not log, and until a signal arrives such a step does
nothing at all. A logging step's collective decides too where the store cannot (its launcher killed).
It replaces Lightning's handler (registered again as each stage starts, hence listen() at each stage's start), which
runs a collective inside the signal handler and can deadlock when ranks are signalled at different points of a step.
"""

import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException

from starter.callbacks.stop_agreement import StopAgreement, stop_line, stop_origin
from starter.errors import PREEMPTED_EXIT_CODE, to_stderr
from starter.models.logging_step import is_logging_step
from starter.topology import process_rank


class SaveOnSigterm(L.Callback):
    listening: "SaveOnSigterm | None" = None  # this process's, once it listens (its watchdog tells it: unheeded)

    def __init__(self, dirpath: str, filename: str = "last.ckpt", signals: Sequence[str] = ("SIGTERM",)):
        self.path = Path(dirpath) / filename
        self.signals = [signal.Signals[name] for name in signals]
        self.received: str | None = None  # the stop signal's name, once one arrived
        self.phase = self.received_in = "setup"  # where the run is, and was when the signal arrived
        self.saved_step: int | None = None  # the step at which this stop saved last.ckpt
        self.agreement: StopAgreement | None = None
        self.unheeded_since: tuple[str, float] | None = None  # a stop signal the watchdog saw, and when

    def listen(self) -> None:
        """Every stop signal this callback's from here on (run.py calls it first, before the model is built)."""
        for signum in self.signals:
            signal.signal(signum, self._request_stop)
        SaveOnSigterm.listening = self

    def unheeded(self, signals: bytes) -> None:
        """The watchdog's call with the signals it saw come (a byte each: signal.set_wakeup_fd), for a stop signal
        the main thread has not acted on within 2 s (it waits in C: a rendezvous, a collective). Where the run has
        nothing to save yet (before training, or after the final save) the process ends now, rank 0 saying the run's
        line; while it trains, the main thread saves (its launcher ends it otherwise)."""
        stops = [signal.Signals(n).name for n in signals if n in self.signals]
        self.unheeded_since = self.unheeded_since or (stops[0], time.monotonic()) if stops else self.unheeded_since
        if not self.unheeded_since or time.monotonic() - self.unheeded_since[1] < 2:
            return
        if self.phase in ("training", "the final save"):
            return
        if process_rank() == 0:
            line = stop_line(self.unheeded_since[0], self.path.parent.parent, self.phase)
            to_stderr(f"error: {line}")
            StopAgreement(1).say_told()
        os._exit(PREEMPTED_EXIT_CODE)

    def origin(self) -> tuple[str, int, str] | None:
        """(signal, node, phase) where the run's stop signal arrived, as the ranks agreed it (stop_agreement.py)."""
        if self.agreement is None:
            return None
        try:
            return stop_origin(self.agreement.store(), self.agreement.prefix.rsplit("/", 1)[0])
        except (OSError, RuntimeError):
            return None

    def _request_stop(self, signum, frame) -> None:
        if self.received is None:
            self.received, self.received_in = signal.Signals(signum).name, self.phase

    def enter(self, phase: str) -> None:
        self.phase = phase

    def stop_here(self, phase: str | None = None) -> None:
        """Where a run can stop with nothing new to save (entering `phase`): it stops if a stop signal has arrived."""
        self.phase = phase or self.phase
        if self.received:
            raise SIGTERMException()

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.listen()
        self.stop_here("setup")

    def on_sanity_check_start(self, trainer, pl_module) -> None:
        self.listen()
        self.stop_here("the sanity check")

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        if trainer.sanity_checking:
            self.stop_here("the sanity check")

    def on_train_start(self, trainer, pl_module) -> None:
        self.listen()
        self.stop_here()  # the state resumed or initialised, no step taken: nothing new to save
        self.phase = "training"
        self.agreement = StopAgreement(trainer.world_size, trainer.global_rank) if trainer.world_size > 1 else None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return  # between optimizer steps the ranks' states differ from a checkpoint's
        requested = self.received is not None
        if self.agreement is None:
            stop = requested
        else:  # every rank gets the same answer: the store's at the agreed step (all of them know), else that of a
            # logging step's collective, where every rank takes part (where the store is gone: its launcher killed)
            origin = f"{self.received}|{trainer.node_rank}|{self.received_in}"
            stop = requested and self.agreement.stop_at(trainer.global_step, origin)
            if not stop and is_logging_step(trainer):
                stop = trainer.strategy.reduce_boolean_decision(requested, all=False)
        if stop:
            if self.received is None:  # another rank's, decided by the collective
                self.received, self.received_in = "a stop signal", self.phase
            trainer.save_checkpoint(self.path)  # written and renamed into place on return (checkpointing/)
            self.saved_step = trainer.global_step
            if self.agreement is not None and trainer.is_global_zero:
                self.agreement.say_saved(trainer.global_step)

    def _stop_if_saved(self, *args, **kwargs) -> None:
        if self.saved_step is not None:
            raise SIGTERMException()

    on_train_batch_start = on_validation_start = on_train_epoch_end = _stop_if_saved

    def on_test_start(self, trainer, pl_module) -> None:
        self.listen()
        self.stop_here("test")

    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.stop_here("test")
