"""Lightning's CSVLogger continuing an existing metrics.csv (a requeued job's, `ckpt_path=auto`) instead of deleting it.
Steps trained again after a SIGKILL appear twice: the `step` column tells them apart."""

import csv

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

from starter.atomic_write import unlink_symlink


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
        unlink_symlink(self.metrics_file_path)
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as f:
                self.metrics_keys = next(csv.reader(f), [])  # new keys later rewrite the header, rows kept
