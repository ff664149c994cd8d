"""Lightning's CSVLogger, except that it continues an existing metrics.csv instead of deleting it.

A requeued job (`ckpt_path=auto`) resumes in its own run directory; Lightning's writer would delete the
metrics.csv of the epochs before the preemption when it starts. Here the old rows stay and the resumed
run's rows follow. After a SIGKILL (not a SIGTERM, which saves where it stops), the steps between the last
checkpoint and the kill are trained again and appear twice: the `step` column tells them apart.
"""

import csv

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter


class ContinuingCSVLogger(CSVLogger):
    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _ContinuingWriter(log_dir=self.log_dir)
        return self._experiment


class _ContinuingWriter(ExperimentWriter):
    def _check_log_dir_exists(self) -> None:  # Lightning's deletes metrics.csv here
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as f:
                self.metrics_keys = next(csv.reader(f), [])  # new keys later rewrite the header, rows kept
