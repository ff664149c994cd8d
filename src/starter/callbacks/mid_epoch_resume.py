"""What a resumed run trains next, said once: at another number of processes than the checkpoint's (a torchrun
restart after a node was lost: `continuing at 1 process (was 2) from step 57`); mid-epoch, a DataModule that shards
itself (ShardedDataModule) continues with the next batch, each sample of the epoch once at any number of processes;
Lightning gives any other DataModule's loaders a fresh iterator, so the interrupted epoch's batches start again from
its first (each sample of the epoch is not seen exactly once)."""

import logging

from starter.callbacks.restored import Restored

log = logging.getLogger(__name__)


class MidEpochResume(Restored):
    per_process_state = True  # a torchft heal leaves it: the healed group's processes keep their own

    def __init__(self):
        self.world, self.saved_world = 1, None  # this run's number of processes; the checkpoint's, where resumed

    def state_dict(self) -> dict:
        return {"world": self.world}

    def load_state_dict(self, state_dict: dict) -> None:
        with self.reading():  # None in a checkpoint that says nothing of it
            self.saved_world = state_dict.get("world")
            if not (self.saved_world is None or type(self.saved_world) is int and self.saved_world > 0):
                raise ValueError(f"world={self.saved_world!r} is no number of processes")

    def on_fit_start(self, trainer, pl_module) -> None:
        self.world = trainer.world_size

    def on_train_start(self, trainer, pl_module) -> None:  # after Lightning restored the checkpoint's loops
        saved, self.saved_world = self.saved_world, None
        if saved not in (None, trainer.world_size) and trainer.is_global_zero:
            processes = f"{trainer.world_size} process{'es' if trainer.world_size > 1 else ''}"
            log.info("continuing at %s (was %d) from step %d", processes, saved, trainer.global_step)
        trained = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        if trainer.ckpt_path is None or trained == 0 or getattr(trainer.datamodule, "shards_itself", False):
            return
        if trainer.is_global_zero:
            log.info(
                "resumed in epoch %d after %d of its batches: %s does not shard itself, so Lightning starts this"
                " epoch's batches again from its first (a DataModule that shards itself resumes at the next batch:"
                " docs/extending.md)",
                trainer.current_epoch + 1,
                trained,
                type(trainer.datamodule).__name__ if trainer.datamodule is not None else "the module's own loader",
            )
