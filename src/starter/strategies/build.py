"""The Lightning strategy object (or "auto") for the `strategy` config group."""

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

# Keys of a strategy config that describe the mode to this starter and are not arguments of its class.
DESCRIPTIVE_KEYS = ("name", "launcher")


def build_strategy(strategy_cfg: DictConfig):
    kwargs = {k: v for k, v in OmegaConf.to_container(strategy_cfg).items() if k not in DESCRIPTIVE_KEYS}
    if "_target_" not in kwargs:
        return strategy_cfg.name  # a name Lightning knows, e.g. "auto"
    return instantiate(kwargs)
