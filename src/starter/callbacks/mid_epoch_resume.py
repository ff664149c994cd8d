"""What a run resumed mid-epoch trains next, said once: a DataModule that shards itself (ShardedDataModule) continues
with the next batch; Lightning gives any other DataModule's loaders a fresh iterator, so the interrupted epoch's
batches start again from its first (each sample of the epoch is not seen exactly once)."""

import logging

import lightning as L

log = logging.getLogger(__name__)


class MidEpochResume(L.Callback):
    def on_train_start(self, trainer, pl_module) -> None:  # after Lightning restored the checkpoint's loops
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
