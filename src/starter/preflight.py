"""Every decision made before anything heavy is imported or any process started: `prepare(cfg)` settles the config in
place in one pass (its values; its data; devices, layout and launcher; what it resumes) and hands on the plan
(topology.Plan). Anything a user can get wrong fails here, in one line."""

import importlib.util
import logging
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from starter.checkpointing.data_split import settle_split
from starter.checkpointing.resume import check_sharded, holds_weights_only, resolve_ckpt_path, saved_config
from starter.config_schema import check_schema
from starter.data.settle import settle_data
from starter.errors import UserError
from starter.launch.environment import launch_plan
from starter.loggers.lifecycle import wandb_run_id
from starter.loggers.report import metric_series
from starter.strategies.pipeline_plan import check_cut, check_pipeline, pipelined
from starter.topology import Plan, lay_out
from starter.untrusted import model_config_dirs

log = logging.getLogger(__name__)
LOGGER_PACKAGES = {"mlflow": "loggers", "wandb": "loggers", "tensorboard": "tensorboard"}  # logger: its extra


def prepare(cfg: DictConfig) -> Plan:
    """Validate a training run's `cfg`, settle it in place, and return its plan."""
    check_schema(cfg)  # given, once, of the types and ranges conf/ takes (config_schema.py)
    global_batch = settle_data(cfg)
    plan = launch_plan(lay_out(cfg, global_batch))
    modules = {"tensorboard": ("tensorboard", "tensorboardX")}  # Lightning's TensorBoardLogger takes either
    for name in cfg.get("logger") or {}:
        if name in LOGGER_PACKAGES and not any(importlib.util.find_spec(m) for m in modules.get(name, (name,))):
            raise UserError(
                f"logger={name} needs the {name} package: pip install -e '.[{LOGGER_PACKAGES[name]}]'"
                f" (or pip install {name})"
            )
    if not cfg.train and cfg.ckpt_path not in (None, "auto", "last") and holds_weights_only(Path(cfg.ckpt_path)):
        log.info("ckpt_path=%s holds weights only: tested as init_from tests them", cfg.ckpt_path)
        cfg.init_from, cfg.ckpt_path = cfg.ckpt_path, None  # a run's model.pt, the final weights
    if cfg.get("init_from"):
        if not Path(cfg.init_from).is_file():
            raise UserError(f"init_from={cfg.init_from}: no such file")
        with open_dict(cfg):  # what may rebuild a model, for the workers (which have no Hydra run to read it from)
            cfg.model_config_dirs = model_config_dirs()
    if (metrics := Path(cfg.paths.output_dir) / "metrics.csv").is_file():  # a run continued: read before training
        metric_series(metrics)
    if cfg.get("checkpoint_store"):
        use_store(cfg)
    path = resolve_ckpt_path(cfg) if cfg.ckpt_path is not None else None
    saved = saved_config(path) if path is not None and cfg.train else None  # the config of the run resumed
    if path is not None:
        check_sharded(path, cfg.strategy.name)
    cfg.ckpt_path = None if path is None else str(path)
    if path is not None:
        settle_split(cfg, path, list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else [])
    if not cfg.train:
        check_evaluation(cfg)
    if "wandb" in (cfg.get("logger") or {}) and cfg.logger.wandb.get("id") is None:
        cfg.logger.wandb.id = wandb_run_id(cfg, saved)
    if path is not None and path.is_dir() and saved is not None:
        check_cut(path, saved, cfg, plan.layout)
    if pipelined(cfg.strategy, plan.layout):
        check_pipeline(cfg, plan)
    return plan


def use_store(cfg: DictConfig) -> None:
    """`checkpoint_store`, checked before training (checkpointing/store.py); `ckpt_path=auto` on a machine whose run
    directory holds no last.ckpt continues from the store's."""
    from starter.checkpointing.store import CheckpointStore, fetch_for_resume
    from starter.launch.nodes import meeting_config

    if cfg.get("fault_tolerance"):
        raise UserError(
            "checkpoint_store with fault_tolerance: not supported yet (the replica groups would share its names);"
            " the groups keep their checkpoints in their own run directories"
        )
    store = CheckpointStore(str(cfg.checkpoint_store))
    store.check(meeting_config(cfg))
    own = Path(cfg.paths.output_dir) / "checkpoints"
    if cfg.ckpt_path == "auto" and not (own / "last.ckpt").exists():
        fetch_for_resume(store, own)


def check_evaluation(cfg: DictConfig) -> None:
    """`train=false` tests exactly the weights given, a checkpoint (`ckpt_path`) or weights (`init_from`): one of
    them, and a test to run."""
    given = [key for key in ("ckpt_path", "init_from") if cfg.get(key)]
    if not cfg.test:
        raise UserError("train=false test=false: nothing to run; train, test a checkpoint, or predict with predict.py")
    if not given:
        raise UserError(
            "train=false tests the weights given: give ckpt_path=PATH (a checkpoint; auto and last: one that exists)"
            " or init_from=PATH (weights)"
        )
    if len(given) > 1:
        raise UserError(f"train=false: give ckpt_path or init_from, not both ({cfg.ckpt_path}, {cfg.init_from})")
