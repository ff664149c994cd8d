"""The layout of a run's processes: how many, on how many nodes, and how they share the work (data, tensor and
pipeline parallel sizes). Computed once, from the settled config and the strategy's traits, and handed to whatever
needs a size (the checks, the launcher, the strategy's device mesh); nothing else does this arithmetic
(torchtitan's ParallelDims). Imports nothing heavy.

The sizes come from the strategy's config: `tensor_parallel_size` and `pipeline_parallel_size` (absent: 1; null:
every process of the run). Data parallel is what is left: the processes of one tensor-parallel group or one
pipeline train on the same batch, so the global batch is shared out over the data-parallel groups only.
"""

from dataclasses import dataclass

from omegaconf import DictConfig, ListConfig

from starter.errors import UserError
from starter.traits import Traits


@dataclass(frozen=True)
class Layout:
    nodes: int
    processes_per_node: int
    tensor_parallel: int = 1
    pipeline_parallel: int = 1

    @property
    def world(self) -> int:
        return self.nodes * self.processes_per_node

    @property
    def data_parallel(self) -> int:
        """Processes that load different batches."""
        return self.world // (self.tensor_parallel * self.pipeline_parallel)

    def batch_per_process(self, global_batch: int) -> int:
        return per_process_batch(global_batch, self.data_parallel)

    @classmethod
    def of(cls, cfg: DictConfig) -> "Layout":
        """The layout of `cfg` (devices and num_nodes settled: preflight.prepare)."""
        traits = Traits.of(cfg.strategy)
        per_node = device_count(cfg.devices) if traits.multi_process else 1
        layout = cls(int(cfg.num_nodes), per_node)
        tp = _size(cfg.strategy, "tensor_parallel_size", layout.world)
        pp = _size(cfg.strategy, "pipeline_parallel_size", layout.world)
        if tp < 1 or pp < 1 or layout.world % (tp * pp):
            sizes = f"strategy.tensor_parallel_size={tp}"
            sizes += f" x strategy.pipeline_parallel_size={pp}" if pp > 1 else ""
            raise UserError(f"{sizes} does not divide the {layout.world} processes (devices x num_nodes)")
        return cls(layout.nodes, per_node, tp, pp)


def _size(strategy_cfg: DictConfig, key: str, world: int) -> int:
    if key not in strategy_cfg:
        return 1
    value = strategy_cfg[key]
    return world if value is None else int(value)


def device_count(devices) -> int:
    """Devices per node for `devices` once settled: a count, or a list of GPU indices."""
    if isinstance(devices, int) and not isinstance(devices, bool):
        return devices
    if isinstance(devices, str) and devices.lstrip("-").isdigit():
        return int(devices)
    if isinstance(devices, (list, tuple, ListConfig)):
        return len(devices)
    raise UserError(f"devices={devices!r}: give a number per node (devices=2), a list of GPUs (devices=[0,2]) or auto")


def per_process_batch(global_batch: int, data_parallel: int) -> int:
    """The share of the global batch one process loads, when `data_parallel` groups load different batches."""
    if global_batch % data_parallel:
        example = max(data_parallel, global_batch // data_parallel * data_parallel)
        raise UserError(f"data.batch_size={global_batch} is the global batch and does not divide by the {data_parallel}"
                        f" processes; use a multiple of {data_parallel}, e.g. data.batch_size={example}")  # fmt: skip
    return global_batch // data_parallel
