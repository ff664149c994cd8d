"""`hparams_search=optuna`: each validation's monitored figure reported to the sweep's Optuna trial (by rank 0), and
the run stopped where the study's pruner says the trial falls behind: every rank stops after the same epoch, the
trial is marked pruned (the sweeper tells the study so). Off (builds to nothing) outside an Optuna sweep."""

import logging

import lightning as L

log = logging.getLogger(__name__)


def optuna_pruning(
    monitor: str, trial: int | None = None, study: str | None = None, storage: str | None = None, pruner=None
) -> "OptunaPruning | None":
    """The callback of the trial the sweeper names (`trial`, `study`, `storage`); None when it names none."""
    return None if trial is None else OptunaPruning(monitor, int(trial), str(study), str(storage), pruner)


class OptunaPruning(L.Callback):
    def __init__(self, monitor: str, trial: int, study: str, storage: str, pruner):
        self.monitor, self.number, self.study, self.storage, self.pruner = monitor, trial, study, storage, pruner
        self.trial = None  # opened by rank 0 at its first report

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        prune = False
        if trainer.is_global_zero and self.monitor in trainer.callback_metrics:
            trial = self.trial or self.open_trial()
            trial.report(float(trainer.callback_metrics[self.monitor]), step=trainer.current_epoch)
            prune = trial.should_prune()
            if prune:
                trial.set_user_attr("pruned_at_epoch", trainer.current_epoch)
                log.info(
                    "optuna: trial %d pruned after epoch %d (%s %.4g falls behind the study's other trials)",
                    self.number,
                    trainer.current_epoch + 1,
                    self.monitor,
                    float(trainer.callback_metrics[self.monitor]),
                )
        if trainer.strategy.broadcast(prune, src=0):  # at validation's end, where the ranks wait for each other
            trainer.should_stop = True

    def open_trial(self):
        import optuna

        from hydra_plugins.optuna_journal_sweeper.sweeper import open_storage

        optuna.logging.disable_default_handler()  # its lines to the run's log file, not the console
        optuna.logging.enable_propagation()
        storage = optuna.storages.get_storage(open_storage(self.storage))
        study = optuna.load_study(study_name=self.study, storage=storage, pruner=self.pruner)
        trial_id = storage.get_trial_id_from_study_id_trial_number(
            storage.get_study_id_from_name(self.study), self.number
        )
        self.trial = optuna.trial.Trial(study, trial_id)
        return self.trial
