"""The Lightning strategy object (or "auto") for the `strategy` config group."""

import logging

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

# Keys of a strategy config that describe the mode to this starter and are not arguments of its class.
DESCRIPTIVE_KEYS = ("name", "launcher", "one_process")


def build_strategy(strategy_cfg: DictConfig, world: int):
    """`world`: the run's process count. A mode that declares `one_process` runs as that strategy in a run of one
    process (ddp: one process has nothing to all-reduce, and DDP's wrapper costs ~15% of a step on one GPU)."""
    if world == 1 and strategy_cfg.get("one_process"):
        log.info("strategy=%s with one process: nothing to all-reduce, so it trains as strategy=%s (the same"
                 " optimisation, without the DDP wrapper)", strategy_cfg.name, strategy_cfg.one_process)  # fmt: skip
        return strategy_cfg.one_process
    kwargs = {k: v for k, v in OmegaConf.to_container(strategy_cfg).items() if k not in DESCRIPTIVE_KEYS}
    if "_target_" not in kwargs:
        return strategy_cfg.name  # a name Lightning knows, e.g. "auto"
    return instantiate(kwargs)
