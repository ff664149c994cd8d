"""A callback whose state a checkpoint restores: that state is someone else's file (starter/untrusted.py), read where
the callback knows which file it is, so a malformed one is one line naming the file and the callback."""

import lightning as L

from starter.untrusted import reading


class Restored(L.Callback):
    restored_from = "the checkpoint"

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:  # before load_state_dict
        self.restored_from = trainer.ckpt_path or self.restored_from

    def reading(self):
        return reading(self.restored_from, part=f"{type(self).__name__} state")
