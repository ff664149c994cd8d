"""What a run does with its loggers besides metrics: the resolved config as their parameters at the start, and each
logger's run ended when the job ends."""

from omegaconf import DictConfig, OmegaConf

from starter.errors import PREEMPTED_EXIT_CODE


def log_config(trainer, cfg: DictConfig) -> None:
    """The run's config as the loggers' parameters (MLflow params, W&B config, TensorBoard hparams), from rank 0."""
    from lightning.pytorch.loggers import CSVLogger

    params = OmegaConf.to_container(cfg, resolve=True)
    for logger in trainer.loggers:
        if not isinstance(logger, CSVLogger):
            logger.log_hyperparams(params)


def end_logger_runs(trainer, exit_code: int = 0) -> None:
    """Every logger's run ends with how the job ended: finished, failed, or killed (143); W&B's too, which Lightning
    leaves open until the process exits (a multirun's next job would log into it)."""
    from lightning.pytorch.loggers import WandbLogger  # importable without wandb installed

    status = {0: "success", PREEMPTED_EXIT_CODE: "KILLED"}.get(exit_code, "failed")
    for logger in trainer.loggers:
        logger.finalize(status)
    if any(isinstance(logger, WandbLogger) for logger in trainer.loggers):
        import wandb

        if wandb.run is not None:
            wandb.finish(exit_code=exit_code)


def wandb_run_id(cfg: DictConfig, saved: DictConfig | None) -> str:
    """The W&B run a run logs to: the saved run's where it resumes one (`saved`: its config), else a new one."""
    import uuid

    previous = OmegaConf.select(saved, "logger.wandb.id") if saved is not None else None
    return previous or uuid.uuid4().hex[:12]
