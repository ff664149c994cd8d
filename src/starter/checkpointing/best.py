"""checkpoints/best.ckpt: Lightning's ModelCheckpoint of the best `monitor` so far. A task that logs no such metric
(a task of one's own names its own) keeps no best.ckpt and its test evaluates the final weights, said once; Lightning
would stop the run with a traceback at the end of the first validation."""

import logging

from starter.checkpointing.run_checkpoint import RunCheckpoint

log = logging.getLogger(__name__)


class BestCheckpoint(RunCheckpoint):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.missing_said = False

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or self.logs_monitor(trainer):
            super().on_validation_end(trainer, pl_module)
        elif trainer.is_global_zero and not self.missing_said:  # validation ran: the task logs no such metric
            logged = ", ".join(sorted(trainer.callback_metrics)) or "nothing"
            log.warning(
                "monitor=%s: the model logs no such metric (it logs %s); no checkpoints/best.ckpt is kept and the test"
                " evaluates the final weights. Set monitor= and monitor_mode= to a metric it logs",
                self.monitor,
                logged,
            )
            self.missing_said = True

    def on_train_epoch_end(self, trainer, pl_module) -> None:  # where Lightning saves when validation ends each epoch
        if self.logs_monitor(trainer):  # missing in an epoch without validation (check_val_every_n_epoch) too
            super().on_train_epoch_end(trainer, pl_module)

    def logs_monitor(self, trainer) -> bool:
        return self.monitor is None or self.monitor in trainer.callback_metrics
