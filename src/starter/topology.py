"""Decided once, before anything heavy is imported: the devices a run has, what its strategy can do, and how its
processes are laid out.

`Traits`: declared in the strategy's config (`traits:` in conf/strategy/<name>.yaml), so no other file names a strategy;
a capability is True, or False or a string saying why not. `Layout` (torchtitan's ParallelDims): nodes, processes per
node, tensor and pipeline parallel sizes (absent: 1; null: every process); data parallel is what is left, and the
global batch is shared over it only.
"""

import logging
import os
from dataclasses import dataclass, fields
from pathlib import Path

from omegaconf import DictConfig, ListConfig

from starter.errors import RANK_VARIABLES, UserError

log = logging.getLogger(__name__)

Support = bool | str
STORE_KEY = "starter/watchdog"
ACCELERATORS = ("auto", "cpu", "gpu", "cuda")
TORCHFT_MISSING = "fault_tolerance=torchft needs torchft: pip install -e '.[ft]'"


@dataclass(frozen=True)
class Traits:
    launcher: str | None = None  # how torch's agent (launch/agent.py) starts one process per device: "forkserver"
    # or "spawn"; None: the run is this one process
    one_process: str | None = None  # what a run of one process trains with instead (ddp: auto, nothing to reduce)
    devices_per_process: str = "one"  # or "all": one process drives every device it is given (dp; needs CUDA)
    pipeline: bool = False  # cuts the net (an nn.Sequential) into stages run by a schedule over micro-batches
    scales_fp16: Support = True  # precision=16-mixed: a loss scaler that works with its gradients
    clips_gradients: Support = True  # trainer.gradient_clip_val: clipped by the norm of the whole model's gradient
    compiles: Support = True  # compile=true
    whole_weights: bool = True  # every process holds every weight (what weight averaging needs)
    syncs_batchnorm: bool = False  # sync_batchnorm=true: BatchNorm statistics over the global batch (GPUs)
    channels_last_weights: bool = True  # conv weights may be stored NHWC (FSDP2 shards contiguous ones only)
    fault_tolerant: Support = "a replica group runs ddp or fsdp (or one process) inside"  # fault_tolerance=torchft

    @classmethod
    def of(cls, strategy_cfg) -> "Traits":
        declared = dict(strategy_cfg.get("traits") or {})
        known = ", ".join(f.name for f in fields(cls))
        if unknown := sorted(declared.keys() - {f.name for f in fields(cls)}):
            raise UserError(f"strategy={strategy_cfg.name} declares unknown traits {unknown}; known: {known}")
        return cls(**declared)

    @property
    def multi_process(self) -> bool:
        return self.launcher is not None


def why_not(support: Support) -> str | None:
    """None where `support` says supported; else the reason it gives ("" when it gives none)."""
    return None if support is True else support if isinstance(support, str) else ""


@dataclass(frozen=True)
class Layout:
    nodes: int
    processes_per_node: int
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    replica_groups: int = 1  # fault_tolerance=torchft: runs of this layout that train together, the data split over all

    @property
    def world(self) -> int:
        return self.nodes * self.processes_per_node

    @property
    def data_parallel(self) -> int:
        """Processes that load different batches."""
        return self.world // (self.tensor_parallel * self.pipeline_parallel)

    @classmethod
    def of(cls, cfg: DictConfig) -> "Layout":
        """The layout of `cfg` (devices and num_nodes settled: settle_devices)."""
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
            raise UserError(
                f"strategy.tensor_parallel_size={tp} would span nodes ({per_node} processes per node):"
                " tensor parallel all-reduces every layer's output and needs a node's links; use a size"
                f" that divides devices={per_node} (strategy=fsdp strategy.tensor_parallel_size={per_node}:"
                " tensor parallel in each node, fsdp across)"
            )
        return cls(layout.nodes, per_node, tp, pp, int((cfg.get("fault_tolerance") or {}).get("replica_groups", 1)))


@dataclass(frozen=True)
class Plan:
    """What preflight settled, handed on to the launch: the strategy's traits, its processes' layout, each process's
    share of a global batch (None: each process's batch is its own), and who starts the processes
    (launch/environment.launch_plan: "ours", "torchrun", a scheduler; None: this process is the run)."""

    traits: Traits
    layout: Layout
    process_batch: int | None = None
    started_by: str | None = None


def lay_out(cfg: DictConfig, global_batch: int | None) -> Plan:
    """What every run settles once its values are checked (training, predict, export): its accelerator and devices (in
    place), its strategy's traits and the layout of its processes, and the run checked against both: its processes,
    each one's share of `global_batch` (None: a batch that is each process's own), what it asks of the strategy."""
    settle_devices(cfg)
    traits = Traits.of(cfg.strategy)
    _check_processes(cfg, traits)
    layout = Layout.of(cfg)
    shares = per_process_batch(global_batch, layout.data_parallel * layout.replica_groups) if global_batch else None
    _check_capabilities(cfg, traits, layout)
    return Plan(traits, layout, shares)


def settle_devices(cfg: DictConfig) -> None:
    """Settle `accelerator` (cpu or gpu; auto: gpu where there is one), `devices=auto|-1|[i, ...]` and `num_nodes`
    once (under torchrun, its sizes), so workers get plain values and a device that does not exist is one line here."""
    if cfg.accelerator not in ACCELERATORS:
        raise UserError(f"accelerator={cfg.accelerator}: choose one of {', '.join(ACCELERATORS)}")
    adopt_torchrun_sizes(cfg)
    gpus = cuda_device_count() if cfg.accelerator != "cpu" else 0
    if cfg.accelerator != "auto" and cfg.accelerator != "cpu" and gpus == 0:
        raise UserError(f"accelerator={cfg.accelerator}: this machine has no CUDA GPU; use accelerator=cpu")
    cfg.accelerator = "gpu" if gpus else "cpu"
    on_gpu, devices = device_type(cfg) == "cuda", cfg.devices
    if devices in ("auto", -1, "-1"):
        cfg.devices = gpus if on_gpu else 1
        log.info("devices=%s: %d (%s)", devices, cfg.devices, "every visible GPU" if on_gpu else "one CPU process")
    elif isinstance(devices, (list, tuple, ListConfig)):
        if not on_gpu:
            raise UserError(
                f"devices={list(devices)} picks GPUs by index; on CPU give a count, e.g. devices={len(devices)}"
            )
        if len(set(devices)) != len(devices) or not all(isinstance(i, int) and 0 <= i < gpus for i in devices):
            raise UserError(f"devices={list(devices)}: this machine has GPUs 0 to {gpus - 1}; name each at most once")
    elif on_gpu and device_count(devices) > gpus:
        raise UserError(
            f"devices={devices}: this machine has {gpus} CUDA GPU(s); use devices={gpus}"
            f" (or accelerator=cpu for {devices} CPU processes)"
        )
    if device_count(cfg.devices) < 1 or int(cfg.num_nodes) < 1:
        raise UserError(f"devices={cfg.devices}, num_nodes={cfg.num_nodes}: both must be at least 1")


def adopt_torchrun_sizes(cfg: DictConfig) -> None:
    """Under torchrun the process counts are torchrun's: take them when the config left the defaults (1 x 1)."""
    if torchrun_id() is None:
        return
    local, total = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["WORLD_SIZE"])
    nodes = total // local
    if (device_count(cfg.devices), int(cfg.num_nodes)) == (local, nodes):
        return
    if (device_count(cfg.devices), int(cfg.num_nodes)) != (1, 1):
        raise UserError(
            f"devices={cfg.devices} num_nodes={cfg.num_nodes}, but torchrun started {local}"
            f" process(es) per node on {nodes} node(s); use devices={local} num_nodes={nodes}, or"
            " leave both out"
        )
    log.info("torchrun: devices=%d num_nodes=%d (from LOCAL_WORLD_SIZE and WORLD_SIZE)", local, nodes)
    cfg.devices, cfg.num_nodes = local, nodes


def cuda_device_count() -> int:
    """GPUs that torch sees; 0 without importing torch (about 2 s) on a machine with no GPU driver at all."""
    if not any(Path(device).exists() for device in ("/dev/nvidiactl", "/dev/kfd")):  # NVIDIA, AMD (ROCm)
        return 0
    import torch

    return torch.cuda.device_count()


def torchrun_id() -> str | None:
    """The run id torchrun gives the processes it started; None where torchrun did not start this one."""
    return os.environ.get("TORCHELASTIC_RUN_ID")


def torchrun_agents_share_their_store() -> bool:
    """Whether torchrun's agents give their workers a store that outlives a restart (torch's default); with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 they do not, and each attempt has a fresh MASTER_PORT (docs/clusters.md)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _check_processes(cfg: DictConfig, traits: Traits) -> None:
    """A strategy of one process runs on one node, and on one device unless it drives them all (dp, on GPUs)."""
    name, devices = cfg.strategy.name, device_count(cfg.devices)
    if traits.multi_process:
        return
    if int(cfg.num_nodes) > 1:
        raise UserError(f"strategy={name} is one process on one machine; use strategy=ddp for several nodes")
    if traits.devices_per_process == "one" and devices > 1:
        raise UserError(
            f"strategy={name} runs one process on one device, but devices={devices}; "
            f"use strategy=ddp (or ddp_spawn) for {devices} processes"
        )
    if devices > 1 and device_type(cfg) == "cpu":
        raise UserError(
            f"strategy={name} splits each batch over CUDA GPUs and this run is on CPU; "
            f"use strategy=ddp devices={devices} for {devices} CPU processes"
        )
    if traits.devices_per_process == "all" and devices == 1:
        log.info("strategy=%s with devices=1 is single-device training: there is nothing to split", name)


def _check_capabilities(cfg: DictConfig, traits: Traits, layout: Layout) -> None:
    """What the run asks for against what the strategy declares (conf/strategy/<name>.yaml, `traits`)."""
    name = cfg.strategy.name
    if cfg.get("compile") and (reason := why_not(traits.compiles)) is not None:
        raise UserError(
            f"compile=true with strategy={name}: {reason or 'not supported'}; use strategy=ddp"
            " (or strategy=auto on one device)"
        )
    if cfg.precision == "16-mixed" and (reason := why_not(traits.scales_fp16)) is not None:
        raise UserError(
            f"strategy={name} cannot scale fp16 losses (16-mixed): {reason or 'not supported'};"
            " use precision=bf16-mixed"
        )
    if (cfg.get("trainer") or {}).get("gradient_clip_val") and (reason := why_not(traits.clips_gradients)) is not None:
        raise UserError(
            f"trainer.gradient_clip_val with strategy={name}: {reason or 'not supported'}; leave gradient clipping off"
        )
    averaging = (cfg.get("callbacks") or {}).get("weight_averaging") or {}
    if averaging.get("decay") is not None and not traits.whole_weights:
        raise UserError(
            f"callbacks.weight_averaging.decay (weight averaging) needs whole weights in each"
            f" process; strategy={name} shards them. Use strategy=ddp, or"
            " callbacks.weight_averaging.decay=null"
        )
    if cfg.get("sync_batchnorm") and layout.world > 1:
        if not traits.syncs_batchnorm:
            raise UserError(f"sync_batchnorm=true is for strategy=ddp or ddp_spawn, not strategy={name}")
        if device_type(cfg) == "cpu":
            raise UserError(
                "sync_batchnorm=true needs GPUs: torch's SyncBatchNorm does not run on CPU (gloo);"
                " on CPU each process normalises with its own batch statistics"
            )
    if cfg.get("fault_tolerance"):
        _check_fault_tolerance(cfg, traits, layout)
    if cfg.strategy.get("cpu_offload") and device_type(cfg) == "cpu":
        raise UserError(
            f"strategy.cpu_offload=true moves {name}'s shards from GPU to CPU memory, and this run is on"
            " CPU already; leave it false"
        )


def _check_fault_tolerance(cfg: DictConfig, traits: Traits, layout: Layout) -> None:
    import importlib.util

    ft, name = cfg.fault_tolerance, cfg.strategy.name
    if (reason := why_not(traits.fault_tolerant)) is not None:
        raise UserError(
            f"fault_tolerance=torchft with strategy={name}: {reason or 'not supported'}; use strategy=ddp or fsdp"
        )
    if layout.data_parallel != layout.world:
        raise UserError(
            f"fault_tolerance=torchft with strategy={name} at tensor_parallel_size={layout.tensor_parallel},"
            f" pipeline_parallel_size={layout.pipeline_parallel}: a replica group shards data only (fsdp inside,"
            " averaged across groups); set both to 1"
        )
    if not ft.replica_group < ft.replica_groups:
        raise UserError(
            f"fault_tolerance.replica_group={ft.replica_group}: the groups are 0 to {ft.replica_groups - 1}"
            f" (fault_tolerance.replica_groups={ft.replica_groups})"
        )
    every = ft.get("sync_every")
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise UserError(
            f"fault_tolerance.sync_every={every}: give a whole number of 1 or more (DiLoCo: the groups meet every"
            " so many steps), or null (they average their gradients every step)"
        )
    if cfg.precision == "16-mixed":
        raise UserError(
            "fault_tolerance=torchft with precision=16-mixed: a joining group would not get the loss scale;"
            " use precision=bf16-mixed"
        )
    if (cfg.get("trainer") or {}).get("accumulate_grad_batches", 1) > 1:
        raise UserError(
            "fault_tolerance=torchft with trainer.accumulate_grad_batches: a step the quorum refuses is trained again"
            " on its batch, and accumulated batches would be lost; raise data.batch_size instead"
        )
    if ft.replica_group and not (ft.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")):
        raise UserError(
            f"replica group {ft.replica_group} needs the lighthouse's address: fault_tolerance.lighthouse="
            f"http://<replica group 0's host>:{ft.lighthouse_port} (group 0 starts it), or TORCHFT_LIGHTHOUSE"
        )
    if importlib.util.find_spec("torchft") is None:
        raise UserError(TORCHFT_MISSING)


def data_parallel_place(trainer) -> tuple[int, int]:
    """(data-parallel size, data-parallel rank) of this process, as its strategy shards data (a tensor-parallel group
    or a pipeline shares one place); (1, 0) without a trainer or a distributed strategy."""
    shard = getattr(trainer.strategy, "distributed_sampler_kwargs", None) if trainer else None
    return (shard["num_replicas"], shard["rank"]) if shard else (1, 0)


def layout_place(trainer) -> tuple:
    """This process's place in the run's layout: ((dimension, size, rank), ...) over its strategy's device mesh
    (pipeline-, data-, tensor-parallel), else its data-parallel place. Equal places hold equal shares of the work."""
    mesh = getattr(trainer.strategy, "device_mesh", None) if trainer else None
    if mesh is None or not getattr(mesh, "mesh_dim_names", None):
        return (("data_parallel", *data_parallel_place(trainer)),)
    return tuple((name, mesh[name].size(), mesh[name].get_local_rank()) for name in mesh.mesh_dim_names)


def process_rank() -> int:
    """This process's global rank before Lightning knows it (RANK_VARIABLES, the first set); 0 for one process."""
    return int(next((os.environ[name] for name in RANK_VARIABLES if name in os.environ), 0))


def node_rank() -> int:
    """This node's rank among the run's nodes (NODE_RANK, as `torchrun --node-rank`); 0 for one node."""
    return int(os.environ.get("NODE_RANK", 0))


def key_prefix(run_id: str | None = None) -> str:
    """The run's keys in its store (the one every process of a several-process run reaches at MASTER_ADDR:MASTER_PORT),
    namespaced per run id and attempt of torch's agent (this process's, or `run_id`'s first): the agent's store
    outlives a restart, and the old keys must not stop it."""
    if (run_id := run_id or torchrun_id()) is not None:
        return f"{STORE_KEY}/{run_id}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}"
    return STORE_KEY


def device_type(cfg: DictConfig) -> str:
    """ "cuda" or "cpu": what every process of the run computes on, once preflight settled `accelerator`."""
    return "cuda" if cfg.accelerator == "gpu" else "cpu"


def _size(strategy_cfg: DictConfig, key: str, world: int) -> int:
    value = strategy_cfg.get(key, 1)  # absent: 1; null: every process
    return world if value is None else int(value)


def nodes_given(num_nodes) -> int:
    """`num_nodes` as given where it is a whole number; 1 where it is not, for what runs before or after the check that
    refuses it in one line (config_schema): the run directory's name, the job's end."""
    return int(num_nodes) if isinstance(num_nodes, int) or str(num_nodes).isdigit() else 1


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
        raise UserError(
            f"data.batch_size={global_batch} is the global batch and does not divide by the {data_parallel}"
            f" processes; use a multiple of {data_parallel}, e.g. data.batch_size={example}"
        )
    return global_batch // data_parallel
