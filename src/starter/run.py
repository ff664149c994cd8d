"""One process's part of a run: build data, model and trainer from the resolved config, fit, test, report."""

import logging
import os
import re
import warnings
from pathlib import Path

import lightning as L
from hydra.utils import instantiate
from omegaconf import DictConfig

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
    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model)
    trainer = instantiate(
        cfg.trainer,
        strategy=build_strategy(cfg.strategy),
        callbacks=[instantiate(c) for c in cfg.callbacks.values()],
        logger=[instantiate(lg) for lg in cfg.logger.values()] or False,
    )
    metrics: dict[str, float] = {}
    if cfg.train:
        trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
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
    return metrics


KNOWN_NOISE = (
    # The run directory also holds config.yaml, so CSVLogger says it "is not empty" (it only replaces metrics.csv).
    "Experiment logs directory",
    # Lightning 2.6 calls a pytree API that torch 2.14 deprecates.
    "`isinstance(treespec",  # (a prefix: PYTHONWARNINGS entries cannot hold commas)
    # torch.distributed.checkpoint rewriting a sharded last.ckpt/best.ckpt, which is the intent.
    "Detected an existing checkpoint",
)


def _silence_known_noise() -> None:
    """Hide warnings a user can do nothing about, here and in processes started later (spawn, workers)."""
    for message in KNOWN_NOISE:
        warnings.filterwarnings("ignore", message=re.escape(message))
    inherited = [w for w in os.environ.get("PYTHONWARNINGS", "").split(",") if w]
    ours = [f"ignore:{message}" for message in KNOWN_NOISE]
    os.environ["PYTHONWARNINGS"] = ",".join(dict.fromkeys(inherited + ours))


def _floats(metrics) -> dict[str, float]:
    return {name: float(value) for name, value in metrics.items()}
