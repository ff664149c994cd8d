"""Checkpoint files written as every file of a run is (starter/atomic_write.py), read weights-only with a refusal
in one line, and removed without following a symlink. Lightning stages the bytes in the system temp directory and
moves them: across file systems a copy, which a kill leaves truncated."""

from pathlib import Path

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from starter.atomic_write import replacing
from starter.checkpointing.sharded import remove_saved
from starter.untrusted import reading


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        with replacing(path, "wb") as file:
            torch.save(checkpoint, file)

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict:
        with reading(path):
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path) -> None:
        remove_saved(Path(path))
