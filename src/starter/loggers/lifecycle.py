"""What a run does with its loggers besides metrics: the resolved config as their parameters at the start, and each
logger's run ended when the job ends."""

from omegaconf import DictConfig, OmegaConf


def log_config(trainer, cfg: DictConfig) -> None:
    """The run's config as the loggers' parameters (MLflow params, W&B config, TensorBoard hparams), from rank 0;
    the CSV logger's run directory already has it in config.yaml."""
    from lightning.pytorch.loggers import CSVLogger

    params = OmegaConf.to_container(cfg, resolve=True)
    for logger in trainer.loggers:
        if not isinstance(logger, CSVLogger):
            logger.log_hyperparams(params)


def end_logger_runs(trainer) -> None:
    """Lightning leaves a W&B run open until the process exits; the next job of a multirun (same process) would
    log into it. Ended here, after fit and test, so each job is a run of its own."""
    from lightning.pytorch.loggers import WandbLogger  # importable without wandb installed

    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger) and logger._experiment is not None:
            logger.experiment.finish()
