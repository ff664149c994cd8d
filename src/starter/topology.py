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
        if per_node % tp:  # tensor parallel is innermost: groups of consecutive processes, within a node if it divides
            raise UserError(f"strategy.tensor_parallel_size={tp} would span nodes ({per_node} processes per node):"
                            " tensor parallel all-reduces every layer's output and needs a node's links; use a size"
                            f" that divides devices={per_node} (strategy=fsdp strategy.tensor_parallel_size={per_node}:"
                            " tensor parallel in each node, fsdp across)")  # fmt: skip
        return cls(layout.nodes, per_node, tp, pp)


PIPELINE_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B"}


def stages_per_process(schedule: str, given: int | None) -> int:
    """The pipeline stages each process runs: as given, else 2 for the interleaved schedule and 1 for the others."""
    return int(given or (2 if schedule == "interleaved_1f1b" else 1))


def pipeline_cut(strategy_cfg: DictConfig, layout: Layout) -> tuple[int, int] | None:
    """(stages of a pipeline, stages per process) where the strategy runs the net as a pipeline; else None."""
    if not (Traits.of(strategy_cfg).pipeline or layout.pipeline_parallel > 1):
        return None
    return layout.pipeline_parallel, stages_per_process(str(strategy_cfg.schedule), strategy_cfg.get("stages_per_rank"))


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
