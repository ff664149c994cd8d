"""The Lightning strategy object (or a name Lightning knows, e.g. "auto") for the `strategy` config group."""

import inspect
import logging
from functools import partial

from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from starter.topology import Layout, Traits

log = logging.getLogger(__name__)

# Keys of a strategy config that describe the mode to this starter (read by topology.py and the traits), not
# arguments of its class.
DESCRIPTIVE_KEYS = ("name", "traits", "tensor_parallel_size", "pipeline_parallel_size")


def build_strategy(strategy_cfg: DictConfig, layout: Layout, fault_tolerance: DictConfig | None = None, agreed="{}"):
    """A strategy whose traits name `one_process` runs as that in a run of one process (ddp: nothing to all-reduce,
    and DDP's wrapper costs ~15% of a step on one GPU). A class whose constructor takes `layout` gets it. Under
    `fault_tolerance` (torchft), the strategy (ddp, fsdp; auto: ddp of one process) with torchft's manager across
    replica groups, which must agree on `agreed` (replica_agreement.agreed_config)."""
    traits = Traits.of(strategy_cfg)
    if layout.world == 1 and traits.one_process and not fault_tolerance:
        log.info(
            "strategy=%s with one process: nothing to all-reduce, so it trains as strategy=%s (the same"
            " optimisation, without the DDP wrapper)",
            strategy_cfg.name,
            traits.one_process,
        )
        return traits.one_process
    kwargs = {k: v for k, v in OmegaConf.to_container(strategy_cfg, resolve=True).items() if k not in DESCRIPTIVE_KEYS}
    if "_target_" not in kwargs and not fault_tolerance:
        return strategy_cfg.name
    kwargs.setdefault("_target_", "lightning.pytorch.strategies.DDPStrategy")  # torchft's, over a group of one process
    strategy_class = get_class(kwargs["_target_"])
    make = instantiate(kwargs, _partial_=True)  # called below: Hydra would turn a dataclass argument into config
    if fault_tolerance:  # torchft's replica groups over the strategy (its traits declared it can)
        from starter.strategies.fault_tolerant import fault_tolerant

        strategy_class = fault_tolerant(strategy_class)
        make = partial(strategy_class, *make.args, **make.keywords, fault_tolerance=fault_tolerance, agreed=agreed)
    constructors = [c.__init__ for c in strategy_class.__mro__ if "__init__" in vars(c)]  # inherited too
    return make(layout=layout) if any("layout" in inspect.signature(f).parameters for f in constructors) else make()
