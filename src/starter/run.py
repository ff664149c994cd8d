"""One process's part of a run: build data, model and trainer from the resolved config, fit, test, report."""

import logging
import os
import re
import warnings
from pathlib import Path

import lightning as L
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig

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
        model = model.to(memory_format=torch.channels_last)
    if cfg.get("compile"):
        model.compile()  # in place: the module, its state dict and checkpoints keep their names
    trainer = build(
        cfg.trainer,
        strategy=build_strategy(cfg.strategy),
        callbacks=[build(c) for c in cfg.callbacks.values()],
        logger=[build(lg) for lg in cfg.logger.values()] or False,
    )
    if cfg.ckpt_path:
        check_checkpoint_fits(model, Path(cfg.ckpt_path))
    metrics: dict[str, float] = {}
    if cfg.train:
        try:
            trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
        except SIGTERMException:
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
        trainer.test(model, datamodule=datamodule, ckpt_path=ckpt_path, verbose=False)
        metrics |= _floats(trainer.callback_metrics)
    if trainer.is_global_zero:
        write_run_outputs(Path(cfg.paths.output_dir), metrics)
    if torch.distributed.is_initialized():
        # Leaving a gloo process group to interpreter shutdown can abort a rank on exit ("terminate called
        # without an active exception", exit -6) after a successful run: close it while every rank is here.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return metrics


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


def check_checkpoint_fits(model, path: Path) -> None:
    """Refuse, before training, a checkpoint whose weights do not fit this model (another net or size)."""
    if path.is_dir():
        return  # a sharded (fsdp) checkpoint: torch.distributed.checkpoint reports mismatches itself on load
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)["state_dict"]
    except Exception as err:
        raise UserError(f"ckpt_path={path} is not a readable Lightning checkpoint: {err}") from err
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
