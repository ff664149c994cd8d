"""Lightning's MLFlowLogger, except that only the process that logs (rank 0) opens the tracking store.

Lightning's constructor makes an MlflowClient, which opens the store, in every rank: two ranks then created one
SQLite store at once and one died in its schema migration ("duplicate column name: step"). Here the client is
made on first use, and Lightning uses it from rank 0 only (`rank_zero_experiment`, `rank_zero_only`).
"""

from unittest import mock

import mlflow.tracking
from lightning.pytorch.loggers import MLFlowLogger


class RankZeroMLFlowLogger(MLFlowLogger):
    def __init__(self, **kwargs):
        with mock.patch.object(mlflow.tracking, "MlflowClient", lambda *args, **kw: None):  # no store opened here
            super().__init__(**kwargs)

    @property
    def _mlflow_client(self):
        if self._client is None:
            self._client = mlflow.tracking.MlflowClient(self._tracking_uri)
        return self._client

    @_mlflow_client.setter
    def _mlflow_client(self, client) -> None:
        self._client = client
