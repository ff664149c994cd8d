"""SIGTERM (a scheduler's preemption, or Ctrl-\\ of the launcher) ends training cleanly with a checkpoint to resume.

Lightning turns SIGTERM into a SIGTERMException after the current batch, on every rank at the same step.
This callback then saves checkpoints/last.ckpt (on an exception of any other kind it saves nothing: the
weights may be what went wrong, e.g. NaN), and run.py exits with errors.PREEMPTED_EXIT_CODE (143) and one line.
"""

from pathlib import Path

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException


class SaveOnSigterm(L.Callback):
    def __init__(self, dirpath: str, filename: str = "last.ckpt"):
        self.path = Path(dirpath) / filename

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):
            trainer.save_checkpoint(self.path)
