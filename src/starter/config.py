"""Checks and settles the composed config before anything heavy is imported or any process is started.

Everything a user can get wrong in the config fails here, in one line, before training: torch is imported only
for the one decision that needs it (whether this machine has CUDA).
"""

import logging
import os
from pathlib import Path

from omegaconf import DictConfig, ListConfig

from starter.errors import UserError

log = logging.getLogger(__name__)

MULTI_PROCESS_LAUNCHERS = ("subprocess", "spawn")
PRECISIONS = ("32", "16-mixed", "bf16-mixed", "bf16-true")
ACCELERATORS = ("auto", "cpu", "gpu", "cuda")
TENSOR_PARALLEL_NETS = ("MLP", "ViT")  # class names of the nets whose layers strategies/tp.py splits


def world_size(cfg: DictConfig) -> int:
    """Processes in the run: devices x num_nodes for multi-process strategies, else 1."""
    if cfg.strategy.get("launcher") not in MULTI_PROCESS_LAUNCHERS:
        return 1
    return device_count(cfg.devices) * int(cfg.num_nodes)


def tensor_parallel_size(cfg: DictConfig) -> int:
    if cfg.strategy.name == "tp":
        return world_size(cfg)
    return int(cfg.strategy.get("tensor_parallel_size", 1))


def data_parallel_size(cfg: DictConfig) -> int:
    """Processes that load different batches: those of one tensor-parallel group, or of one pipeline, share theirs."""
    if cfg.strategy.name == "pp":
        return 1
    return world_size(cfg) // tensor_parallel_size(cfg)


def device_count(devices) -> int:
    """Processes per node for `devices` once settled by `prepare`: a count, or a list of GPU indices."""
    if isinstance(devices, int) and not isinstance(devices, bool):
        return devices
    if isinstance(devices, str) and devices.lstrip("-").isdigit():
        return int(devices)
    if isinstance(devices, (list, tuple, ListConfig)):
        return len(devices)
    raise UserError(f"devices={devices!r}: give a number per node (devices=2), a list of GPUs (devices=[0,2]) or auto")


def external_launcher(cfg: DictConfig) -> str | None:
    """Who started every rank of this run already: "torchrun", "slurm" (one task per rank), or None (nobody:
    one process, or our launcher starts the workers; then SLURM's variables must not decide the ranks)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return "torchrun"
    tasks = slurm_tasks()
    if tasks <= 1:
        return None
    if tasks != world_size(cfg):
        raise UserError(
            f"SLURM started {tasks} tasks but devices x num_nodes = {world_size(cfg)}; ask SLURM for one task per"
            f" device (--ntasks-per-node=<devices>), or for one task (--ntasks=1) and let train.py start the workers"
        )
    return "slurm"


def slurm_tasks() -> int:
    """SLURM_NTASKS of an `srun` step; 0 outside SLURM and in an interactive shell (Lightning's own rule)."""
    if os.environ.get("SLURM_JOB_NAME") in ("bash", "interactive"):
        return 0
    return int(os.environ.get("SLURM_NTASKS", 0))


def per_process_batch_size(global_batch_size: int, world: int) -> int:
    if global_batch_size % world:
        raise UserError(
            f"data.batch_size={global_batch_size} is the global batch and does not divide by the {world} processes;"
            f" use a multiple of {world}, e.g. data.batch_size={max(world, global_batch_size // world * world)}"
        )
    return global_batch_size // world


def prepare(cfg: DictConfig) -> None:
    """Validate `cfg` and settle, in place, what must be fixed before launch (precision on CPU, `ckpt_path=last`)."""
    _adopt_torchrun_sizes(cfg)
    if str(cfg.precision) not in PRECISIONS:
        raise UserError(f"precision={cfg.precision}: choose one of {', '.join(PRECISIONS)}")
    _settle_accelerator_and_devices(cfg)
    _settle_num_classes(cfg)
    devices = device_count(cfg.devices)
    if devices < 1 or int(cfg.num_nodes) < 1:
        raise UserError(f"devices={cfg.devices}, num_nodes={cfg.num_nodes}: both must be at least 1")
    _check_strategy(cfg, devices)
    _check_model_parallel(cfg)
    _check_sync_batchnorm(cfg)
    _check_weight_averaging(cfg)
    _check_fixed_input_size(cfg)
    _check_logger_packages(cfg)
    per_process_batch_size(int(cfg.data.batch_size), data_parallel_size(cfg))
    _check_nodes(cfg)
    _redirect_fp16_on_cpu(cfg)
    if cfg.ckpt_path is not None:
        path = resolve_ckpt_path(cfg)
        if path is not None and path.is_dir() and cfg.strategy.name != (writer := sharding_strategy(path)):
            raise UserError(
                f"ckpt_path={path} is a sharded ({writer}) checkpoint; resume or evaluate it with strategy={writer}"
            )
        cfg.ckpt_path = None if path is None else str(path)


def _settle_num_classes(cfg: DictConfig) -> None:
    """An image folder's class count, when the config leaves it out (null): its class folders under train/."""
    if cfg.data.get("num_classes", 0) is not None or "root" not in cfg.data:
        return
    train = Path(cfg.data.root) / "train"
    if not train.is_dir():
        raise UserError(
            f"no directory {train}: data.num_classes is read from its class folders; point data.root at"
            " a tree of <root>/train/<class>/* and <root>/val/<class>/*, or give data.num_classes"
        )
    cfg.data.num_classes = sum(1 for entry in train.iterdir() if entry.is_dir())


def _check_logger_packages(cfg: DictConfig) -> None:
    import importlib.util

    extras = {"mlflow": "loggers", "wandb": "loggers", "tensorboard": "tensorboard"}
    modules = {"tensorboard": ("tensorboard", "tensorboardX")}  # Lightning's TensorBoardLogger takes either
    for name in cfg.get("logger") or {}:
        if name in extras and not any(importlib.util.find_spec(m) for m in modules.get(name, (name,))):
            raise UserError(f"logger={name} needs the {name} package: pip install -e '.[{extras[name]}]'"
                            f" (or pip install {name})")  # fmt: skip


def _check_fixed_input_size(cfg: DictConfig) -> None:
    """A net built for one image size (a ViT's position embedding) must get that size in training and evaluation."""
    size = cfg.model.net.get("image_size")
    crops = {key: cfg.data.get(key) for key in ("train_crop_size", "val_crop_size")}
    if size is None or all(crop in (None, size) for crop in crops.values()):
        return
    given = ", ".join(f"data.{key}={crop}" for key, crop in crops.items() if crop not in (None, size))
    raise UserError(f"the net takes {size}x{size} images only (model.net.image_size, from data.image_shape) "
                    f"but {given}; use {size}, or change data.image_shape")  # fmt: skip


def _check_weight_averaging(cfg: DictConfig) -> None:
    if cfg.model.get("ema_decay") is not None and cfg.strategy.name in ("fsdp", "tp", "pp"):
        raise UserError(f"model.ema_decay (weight averaging) needs whole weights in each process; strategy="
                        f"{cfg.strategy.name} shards them. Use strategy=ddp, or model.ema_decay=null")  # fmt: skip


def _check_sync_batchnorm(cfg: DictConfig) -> None:
    if not cfg.get("sync_batchnorm") or world_size(cfg) == 1:
        return
    if cfg.strategy.name not in ("ddp", "ddp_spawn"):
        raise UserError(f"sync_batchnorm=true is for strategy=ddp or ddp_spawn, not strategy={cfg.strategy.name}")
    if runs_on_cpu(cfg):
        raise UserError("sync_batchnorm=true needs GPUs: torch's SyncBatchNorm does not run on CPU (gloo);"
                        " on CPU each process normalises with its own batch statistics")  # fmt: skip


def _adopt_torchrun_sizes(cfg: DictConfig) -> None:
    """Under torchrun the process counts are torchrun's: take them when the config left the defaults (1 x 1)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    local, total = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["WORLD_SIZE"])
    nodes = total // local
    if (device_count(cfg.devices), int(cfg.num_nodes)) == (local, nodes):
        return
    if (device_count(cfg.devices), int(cfg.num_nodes)) != (1, 1):
        raise UserError(
            f"devices={cfg.devices} num_nodes={cfg.num_nodes}, but torchrun started {local} process(es) per node"
            f" on {nodes} node(s); use devices={local} num_nodes={nodes}, or leave both out"
        )
    log.info("torchrun: devices=%d num_nodes=%d (from LOCAL_WORLD_SIZE and WORLD_SIZE)", local, nodes)
    cfg.devices, cfg.num_nodes = local, nodes


def cuda_device_count() -> int:
    """GPUs that torch sees; 0 without importing torch (about 2 s) on a machine with no GPU driver at all."""
    if not any(Path(device).exists() for device in ("/dev/nvidiactl", "/dev/kfd")):  # NVIDIA, AMD (ROCm)
        return 0
    import torch

    return torch.cuda.device_count()


def runs_on_cpu(cfg: DictConfig) -> bool:
    return cfg.accelerator == "cpu"


def _settle_accelerator_and_devices(cfg: DictConfig) -> None:
    """Decide `accelerator=auto` and `devices=auto|-1|[i, ...]` here, once, so every worker gets plain values
    and a device that does not exist is one line here rather than an exception in each worker."""
    if cfg.accelerator not in ACCELERATORS:
        raise UserError(f"accelerator={cfg.accelerator}: choose one of {', '.join(ACCELERATORS)}")
    gpus = cuda_device_count() if cfg.accelerator in ("auto", "gpu", "cuda") else 0
    if cfg.accelerator == "auto":
        cfg.accelerator = "gpu" if gpus else "cpu"
    if cfg.accelerator in ("gpu", "cuda") and gpus == 0:
        raise UserError(f"accelerator={cfg.accelerator}: this machine has no CUDA GPU; use accelerator=cpu")
    on_gpu, devices = cfg.accelerator in ("gpu", "cuda"), cfg.devices
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


def _check_nodes(cfg: DictConfig) -> None:
    """Our launcher on several nodes needs the rendezvous address on every node: say so before anything waits."""
    if cfg.strategy.get("launcher") not in MULTI_PROCESS_LAUNCHERS or external_launcher(cfg):
        return
    nodes = int(cfg.num_nodes)
    if os.environ.get("MASTER_PORT") and not os.environ.get("MASTER_ADDR"):
        raise UserError("MASTER_PORT is set but MASTER_ADDR is not; set MASTER_ADDR to the host of node 0")
    if nodes == 1:
        return
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK") if not os.environ.get(name)]
    if missing:
        raise UserError(
            f"num_nodes={nodes}: set {', '.join(missing)} on every node (MASTER_ADDR and MASTER_PORT the same"
            f" everywhere, NODE_RANK 0 to {nodes - 1})"
        )
    if not 0 <= int(os.environ["NODE_RANK"]) < nodes:
        raise UserError(f"NODE_RANK={os.environ['NODE_RANK']}: with num_nodes={nodes} it must be 0 to {nodes - 1}")


def _check_strategy(cfg: DictConfig, devices: int) -> None:
    name = cfg.strategy.name
    if name == "auto" and devices > 1:
        raise UserError(
            f"strategy=auto runs one process on one device, but devices={devices}; "
            f"use strategy=ddp (or ddp_spawn) for {devices} processes"
        )
    if name == "dp":
        if int(cfg.num_nodes) > 1:
            raise UserError("strategy=dp is one process on one machine; use strategy=ddp for several nodes")
        if devices > 1 and runs_on_cpu(cfg):
            raise UserError(
                f"strategy=dp splits each batch over CUDA GPUs and this run is on CPU; "
                f"use strategy=ddp devices={devices} for {devices} CPU processes"
            )
        if cfg.get("compile"):
            raise UserError(
                "compile=true with strategy=dp: DataParallel copies the module for every step, which torch.compile"
                " cannot follow; use strategy=ddp (or strategy=auto on one device)"
            )
        if devices == 1:
            log.info("strategy=dp with devices=1 is single-device training: there is nothing to split")
    if cfg.strategy.get("cpu_offload") and runs_on_cpu(cfg):
        raise UserError(f"strategy.cpu_offload=true moves {name}'s shards from GPU to CPU memory, and this run is on"
                        " CPU already; leave it false")  # fmt: skip
    if name in ("fsdp", "tp", "pp") and cfg.precision == "16-mixed" and not runs_on_cpu(cfg):
        # fp16 needs a sharded gradient scaler, which Lightning's ModelParallelStrategy does not provide, or (pp)
        # one inside the pipeline schedule.
        where = " inside its schedule" if name == "pp" else ""
        raise UserError(f"strategy={name} cannot scale fp16 losses (16-mixed){where}; use precision=bf16-mixed")


def _check_model_parallel(cfg: DictConfig) -> None:
    """Tensor parallel (tp, fsdp with tensor_parallel_size) and pipeline parallel (pp): what they can run."""
    name, world, tp = cfg.strategy.name, world_size(cfg), tensor_parallel_size(cfg)
    if tp > 1:
        net = str(cfg.model.net.get("_target_", "")).rsplit(".", 1)[-1]
        if net not in TENSOR_PARALLEL_NETS:
            raise UserError(f"strategy={name} splits the Linear layers of model=mlp or model=vit; this model's net"
                            f" ({net}) has none it can split; use strategy=fsdp or ddp for it")  # fmt: skip
        if world % tp:
            raise UserError(f"strategy.tensor_parallel_size={tp} does not divide the {world} processes")
        for key in ("heads", "width"):
            if key in cfg.model.net and int(cfg.model.net[key]) % tp:
                raise UserError(f"model.net.{key}={cfg.model.net[key]} does not split over {tp} tensor-parallel"
                                f" processes; use a multiple of {tp}")  # fmt: skip
    if (tp > 1 or name == "pp") and cfg.trainer.get("gradient_clip_val"):
        raise UserError(f"trainer.gradient_clip_val with strategy={name}: the gradient norm would be one shard's or"
                        " one stage's, not the model's; leave gradient clipping off")  # fmt: skip
    if name != "pp":
        return
    if cfg.get("compile"):
        raise UserError("compile=true with strategy=pp: the pipeline schedule runs the stages; use strategy=ddp")
    batch, micro = int(cfg.data.batch_size), int(cfg.strategy.microbatches)
    if batch % micro:
        raise UserError(f"data.batch_size={batch} does not split into strategy.microbatches={micro}; every process"
                        f" of a pipeline runs the whole batch: use a multiple of {micro}")  # fmt: skip
    if cfg.strategy.schedule == "interleaved_1f1b" and micro >= world and micro % (micro // world):
        raise UserError(f"strategy.microbatches={micro}: interleaved_1f1b on {world} processes needs a multiple"
                        f" of {world}")  # fmt: skip


def _redirect_fp16_on_cpu(cfg: DictConfig) -> None:
    # Lightning would make the same switch with a multi-line warning; say it once, up front, and record it.
    if cfg.precision != "16-mixed" or not runs_on_cpu(cfg):
        return
    log.warning("precision=16-mixed: CPUs have no fp16 autocast; running bf16-mixed (say precision=bf16-mixed)")
    cfg.precision = "bf16-mixed"


def sharding_strategy(checkpoint: Path) -> str:
    """The strategy (fsdp, tp, pp) that wrote a sharded checkpoint directory: its run's config says."""
    config = checkpoint.resolve().parent.parent / "config.yaml"
    if config.is_file():
        from omegaconf import OmegaConf

        return str(OmegaConf.load(config).strategy.name)
    return "fsdp"


def resolve_ckpt_path(cfg: DictConfig) -> Path | None:
    """`last`: the newest checkpoints/last.ckpt among this task's runs. `auto`: this run directory's own
    last.ckpt if it has one (a requeued SLURM job continues), else none (a fresh start). Else: a path that exists."""
    if cfg.ckpt_path == "auto":
        own = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
        if own.exists():
            log.info("ckpt_path=auto -> %s (resuming this run)", own)
            return own
        return None
    if cfg.ckpt_path == "last":
        task_dir = Path(cfg.paths.log_dir) / cfg.task_name
        this_run = Path(cfg.paths.output_dir).resolve()
        found = [p for p in task_dir.glob("**/checkpoints/last.ckpt") if this_run not in p.resolve().parents]
        if not found:
            raise UserError(f"ckpt_path=last: no checkpoints/last.ckpt under {task_dir}; train first or give a path")
        newest = max(found, key=lambda p: p.stat().st_mtime)
        log.info("ckpt_path=last -> %s", newest)
        return newest
    path = Path(cfg.ckpt_path)
    if not path.exists():  # a file, or a directory for sharded (fsdp) checkpoints
        raise UserError(f"ckpt_path={cfg.ckpt_path}: no such file")
    return path
