"""One process's part of a run: build data, model and trainer from the resolved config, fit, test, report."""

import logging
import os
import pickle
import re
import warnings
from contextlib import contextmanager
from pathlib import Path

import lightning as L
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig

from starter.callbacks.compile import CompileModule
from starter.callbacks.epoch_stats import EpochStats
from starter.callbacks.progress import progress_bar
from starter.callbacks.resume_schedule import ResumeSchedule
from starter.callbacks.tf32 import TF32
from starter.config import external_launcher, world_size
from starter.errors import PREEMPTED_EXIT_CODE, UserError
from starter.export import save_full_weights
from starter.report import write_run_outputs
from starter.strategies.build import build_strategy

log = logging.getLogger(__name__)

if logging.getLogger().hasHandlers():
    # `lightning` brings its own console handler and also propagates to the root's (Hydra's console and
    # train.log, or the worker's): keep the root's only, so each line is printed once and also logged to file.
    logging.getLogger("lightning").handlers.clear()


def run(cfg: DictConfig) -> dict[str, float]:
    """Returns the final metrics (`train/loss`, `val/loss`, `val/acc`, `test/loss`, `test/acc` where run)."""
    _silence_known_noise()
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = build(cfg.data)
    model = build(cfg.model)
    if cfg.get("channels_last"):
        use_channels_last(model, weights=cfg.strategy.name != "fsdp")
    trainer = build(
        cfg.trainer,
        strategy=build_strategy(cfg.strategy, world_size(cfg)),
        callbacks=[build(c) for c in cfg.callbacks.values()] + built_in_callbacks(cfg),
        logger=[build(lg) for lg in cfg.logger.values()] or False,
        plugins=[build(p) for p in cfg.trainer.get("plugins") or []] + cluster_environment(cfg),
    )
    log_config(trainer, cfg)
    if cfg.ckpt_path:
        check_checkpoint_fits(model, Path(cfg.ckpt_path))
    metrics: dict[str, float] = {}
    if cfg.train:
        try:
            with refusing_pickled_code(cfg.ckpt_path):
                trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.ckpt_path, weights_only=True)
        except SIGTERMException:
            if trainer.is_global_zero:
                log.warning("stopped by SIGTERM at step %d; resume with ckpt_path=last", trainer.global_step)
            raise SystemExit(PREEMPTED_EXIT_CODE) from None
        metrics |= _floats(trainer.callback_metrics)
        save_full_weights(trainer, Path(cfg.paths.output_dir) / "checkpoints" / "model.pt")
    if cfg.test:
        if cfg.train:
            best = [c.best_model_path for c in trainer.checkpoint_callbacks if c.monitor and c.best_model_path]
            ckpt_path = best[0] if best else None  # no best checkpoint (callbacks=none, fast_dev_run): final weights
        else:
            ckpt_path = cfg.ckpt_path
        with refusing_pickled_code(ckpt_path):
            trainer.test(model, datamodule=datamodule, ckpt_path=ckpt_path, verbose=False, weights_only=True)
        metrics |= _floats(trainer.callback_metrics)
    if trainer.is_global_zero:
        write_run_outputs(Path(cfg.paths.output_dir), metrics)
    end_logger_runs(trainer)
    if torch.distributed.is_initialized():
        # Leaving a gloo process group to interpreter shutdown can abort a rank on exit ("terminate called
        # without an active exception", exit -6) after a successful run: close it while every rank is here.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return metrics


def log_config(trainer, cfg: DictConfig) -> None:
    """The run's config as the loggers' parameters (MLflow params, W&B config, TensorBoard hparams), from rank 0;
    the CSV logger's run directory already has it in config.yaml."""
    from lightning.pytorch.loggers import CSVLogger
    from omegaconf import OmegaConf

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


KNOWN_NOISE = (
    # Lightning 2.6 calls a pytree API that torch 2.14 deprecates.
    "`isinstance(treespec",  # (a prefix: PYTHONWARNINGS entries cannot hold commas)
)


def _silence_known_noise() -> None:
    """Hide warnings a user can do nothing about, here and in processes started later (spawn, workers)."""
    for message in KNOWN_NOISE:
        warnings.filterwarnings("ignore", message=re.escape(message))
    inherited = [w for w in os.environ.get("PYTHONWARNINGS", "").split(",") if w]
    ours = [f"ignore:{message}" for message in KNOWN_NOISE]
    os.environ["PYTHONWARNINGS"] = ",".join(dict.fromkeys(inherited + ours))


def build(node, **kwargs):
    """hydra.utils.instantiate, letting a UserError raised by a constructor through as itself."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as err:
        if isinstance(err.__cause__, UserError):
            raise err.__cause__ from None
        raise


def built_in_callbacks(cfg: DictConfig) -> list:
    """What the config asks for: TF32 on GPUs (set in every process), the resumed lr schedule and the per-epoch
    figures (always), an exponential moving average of the weights (model.ema_decay), torch.compile in the
    training process, and the progress display (a throttled bar on a terminal, a line per epoch in a log)."""
    compiling = [CompileModule(**cfg.get("compile_options", {}))] if cfg.get("compile") else []
    bar = [progress_bar()] if cfg.trainer.get("enable_progress_bar", True) else []
    averaging = []
    if cfg.model.get("ema_decay") is not None:  # validation, test, best.ckpt and model.pt get the averaged weights
        from starter.callbacks.weight_averaging import AveragedWeights

        warmup = int(cfg.model.get("lr_warmup_epochs") or 0)
        averaging = [AveragedWeights(decay=float(cfg.model.ema_decay), warmup_epochs=warmup)]
    tf32 = TF32(bool(cfg.get("tf32", True)))
    return [tf32, ResumeSchedule(cfg.get("resume_lr_schedule", "replan")), EpochStats(), *averaging, *compiling, *bar]


def cluster_environment(cfg: DictConfig) -> list:
    """Where this process's rank comes from. Lightning reads torchrun's or SLURM's variables when they started
    every rank; otherwise the ranks are ours (our launcher's workers, ddp_spawn, one process), also inside a SLURM
    job of fewer tasks, whose SLURM_PROCID would make every worker rank 0 of a world of 1."""
    if external_launcher(cfg):
        return []
    from lightning.fabric.plugins.environments import LightningEnvironment

    return [LightningEnvironment()]


def use_channels_last(model: torch.nn.Module, weights: bool) -> None:
    """NHWC activations: every conv layer gets its input as channels_last (a no-op when it already is), and
    the conv weights too where the strategy allows it (FSDP2 shards only contiguous parameters)."""
    if weights:
        model.to(memory_format=torch.channels_last)
    for module in model.modules():
        if isinstance(module, torch.nn.Conv2d):
            module.register_forward_pre_hook(_channels_last_input)


def _channels_last_input(conv, args):
    return (args[0].contiguous(memory_format=torch.channels_last), *args[1:])


@contextmanager
def refusing_pickled_code(path):
    """Checkpoints load weights-only: one that holds a pickled object (code that would run) is refused in one line."""
    try:
        yield
    except pickle.UnpicklingError as err:
        raise UserError(
            f"ckpt_path={path} holds pickled objects besides tensors ({str(err).splitlines()[0][:120]}...);"
            " refused: loading it could run code. Load only checkpoints written by this starter"
        ) from None


def check_checkpoint_fits(model, path: Path) -> None:
    """Refuse, before training, a checkpoint whose weights do not fit this model (another net or size)."""
    if path.is_dir():
        return  # a sharded (fsdp) checkpoint: torch.distributed.checkpoint reports mismatches itself on load
    try:
        with refusing_pickled_code(path):
            saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)["state_dict"]
    except UserError:
        raise
    except Exception as err:
        raise UserError(f"ckpt_path={path} is not a readable Lightning checkpoint: {str(err).splitlines()[0]}") from err
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    found = {k: tuple(v.shape) for k, v in saved.items()}
    if expected != found:
        missing, unexpected = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
        resized = sorted(k for k in expected.keys() & found.keys() if expected[k] != found[k])
        raise UserError(
            f"ckpt_path={path} holds weights of a different model (missing {missing[:3]}, unexpected"
            f" {unexpected[:3]}, other shapes {resized[:3]}); use the model config of the run that saved it"
        )


def _floats(metrics) -> dict[str, float]:
    return {name: float(value) for name, value in metrics.items()}
