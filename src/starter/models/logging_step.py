"""Whether Lightning writes the training logs at the end of the batch under way: the one place deciding when a value may
be read on the host (self.log, the NaN check, the stop agreement, the progress display, the pipeline's output
broadcast). Lightning's own rule (LoggerConnector.should_update_logs), which it does not expose."""


def is_logging_step(trainer) -> bool:
    every = trainer.log_every_n_steps
    if not every:
        return False
    return steps_optimizer(trainer) and (trainer.fit_loop.epoch_loop._batches_that_stepped + 1) % every == 0


def steps_optimizer(trainer) -> bool:
    """Whether the batch now under way ends in an optimizer step (not one whose gradients are accumulated)."""
    return not trainer.fit_loop._should_accumulate()
