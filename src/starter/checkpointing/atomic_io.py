"""Checkpoint files written as every file of a run is (starter/atomic_write.py). Lightning stages the bytes in the
system temp directory and moves them: across file systems a copy, which a kill leaves truncated."""

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from starter.atomic_write import replacing


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        with replacing(path, "wb") as file:
            torch.save(checkpoint, file)
