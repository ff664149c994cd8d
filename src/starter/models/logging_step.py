"""Whether Lightning writes the training logs at the end of the batch now under way. The one place this is decided
for everything that reads a value on the host only then, keeping other steps free of host syncs and collectives:
the module's `self.log`, the NaN check, the SIGTERM agreement between ranks, the progress display, the pipeline's
broadcast of its output. Lightning's own rule (LoggerConnector.should_update_logs), which it does not expose:
every `trainer.log_every_n_steps`-th optimizer step, on the batch that steps the optimizer. The same answer
anywhere from `on_train_batch_start` to `on_train_batch_end`."""


def is_logging_step(trainer) -> bool:
    every = trainer.log_every_n_steps
    if not every:
        return False
    return steps_optimizer(trainer) and (trainer.fit_loop.epoch_loop._batches_that_stepped + 1) % every == 0


def steps_optimizer(trainer) -> bool:
    """Whether the batch now under way ends in an optimizer step (not one whose gradients are accumulated)."""
    return not trainer.fit_loop._should_accumulate()
