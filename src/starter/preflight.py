"""Every decision made before anything heavy is imported or any process started: `prepare(cfg)` settles the config in
place, computes the layout, and checks the run against what the strategy declares (its traits). Anything a user can get
wrong fails here, in one line."""

import importlib.util
import logging
import signal
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from starter.checkpointing.record import model_builders
from starter.checkpointing.resume import check_sharded, resolve_ckpt_path, saved_config
from starter.config_schema import check_schema
from starter.data.shard_set import describe  # full examples
from starter.declared import declared
from starter.errors import UserError
from starter.launch.environment import adopt_torchrun_sizes, check_rendezvous, cuda_device_count, launched_by
from starter.loggers.lifecycle import wandb_run_id
from starter.strategies.pipeline_plan import check_cut, check_pipeline, pipelined
from starter.topology import Layout, Traits, device_count, device_type, per_process_batch, why_not

log = logging.getLogger(__name__)

PRECISIONS = ("32", "16-mixed", "bf16-mixed", "bf16-true")
ACCELERATORS = ("auto", "cpu", "gpu", "cuda")


def prepare(cfg: DictConfig) -> Layout:
    """Validate a training run's `cfg`, settle it in place, and return the layout of its processes."""
    with open_dict(cfg):  # data=none, '~data': no DataModule, the module's own loaders (run.py)
        cfg.data = cfg.get("data") or {}
    _settle_shards(cfg)  # full examples
    # a global batch where the DataModule shards itself (shared over the processes); another's batch size is its own
    global_batch = cfg.data.batch_size if data_shards_itself(cfg.data) else None
    layout, traits = settle(cfg, global_batch), Traits.of(cfg.strategy)
    settle_num_classes(cfg)
    _check_capabilities(cfg, traits, layout)
    if pipelined(cfg.strategy, layout):
        check_pipeline(cfg, layout, global_batch)
    extras = {"mlflow": "loggers", "wandb": "loggers", "tensorboard": "tensorboard"}
    modules = {"tensorboard": ("tensorboard", "tensorboardX")}  # Lightning's TensorBoardLogger takes either
    for name in cfg.get("logger") or {}:
        if name in extras and not any(importlib.util.find_spec(m) for m in modules.get(name, (name,))):
            raise UserError(
                f"logger={name} needs the {name} package: pip install -e '.[{extras[name]}]' (or pip install {name})"
            )
    if cfg.get("init_from"):
        if not Path(cfg.init_from).is_file():
            raise UserError(f"init_from={cfg.init_from}: no such file")
        with open_dict(cfg):  # what may rebuild a model, for the workers (which have no Hydra run to read it from)
            cfg.model_builders = sorted(model_builders())
    path = resolve_ckpt_path(cfg) if cfg.ckpt_path is not None else None
    saved = saved_config(path) if path is not None and cfg.train else None  # the config of the run resumed
    if path is not None:
        check_sharded(path, cfg.strategy.name)
        if path.is_dir() and saved is not None:
            check_cut(path, saved, cfg, layout)
    cfg.ckpt_path = None if path is None else str(path)
    if "wandb" in (cfg.get("logger") or {}) and cfg.logger.wandb.get("id") is None:
        cfg.logger.wandb.id = wandb_run_id(cfg, saved)
    return layout


def whole_number(key: str, value, least: int, most: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least or (most is not None and value > most):
        within = f"from {least} to {most}" if most is not None else f"of {least} or more"
        raise UserError(f"{key}={'null' if value is None else value}: give a whole number {within}")


def data_shards_itself(data: DictConfig) -> bool:
    """Whether the DataModule declares that it shards its data itself (`shards_itself = True`, as ShardedDataModule
    does): then `data.batch_size` is the global batch, checked here. Any other is sharded as Lightning shards it (its
    DistributedSampler), with the batch size its DataLoaders give. Read off its class's source (declared.py); what
    the source does not say is decided by the class itself in each process (run.py), and checked there."""
    return "_target_" in data and bool(declared(str(data._target_), "shards_itself", key="data._target_"))


def settle(cfg: DictConfig, global_batch: int | None) -> Layout:
    """What every run settles (training, predict): precision, devices, layout, equal shares of `global_batch` (None:
    a batch that is each process's own)."""
    check_schema(cfg)  # the keys' types and ranges (config_schema.py)
    _check_one_copy(cfg)
    adopt_torchrun_sizes(cfg)
    if str(cfg.precision) not in PRECISIONS:
        raise UserError(f"precision={cfg.precision}: choose one of {', '.join(PRECISIONS)}")
    if unknown := [name for name in cfg.get("stop_signals") or [] if name not in signal.Signals.__members__]:
        raise UserError(
            f"stop_signals: {', '.join(map(str, unknown))} is no signal here; use names such as SIGTERM,"
            " SIGUSR1, SIGUSR2"
        )
    _settle_accelerator_and_devices(cfg)
    if device_count(cfg.devices) < 1 or int(cfg.num_nodes) < 1:
        raise UserError(f"devices={cfg.devices}, num_nodes={cfg.num_nodes}: both must be at least 1")
    traits = Traits.of(cfg.strategy)
    _check_processes(cfg, traits)
    layout = Layout.of(cfg)
    if global_batch is not None:
        per_process_batch(global_batch, layout.data_parallel)
    if launched_by(layout.world, traits.multi_process) == "ours":
        check_rendezvous(layout.nodes)
    return layout


def _check_one_copy(cfg: DictConfig) -> None:
    """`accelerator`, `devices`, `num_nodes`, `precision` and `strategy` are top-level keys, the ones the checks and the
    launcher read; `trainer.<key>` follows them (`${key}`) or is absent. One set there instead (`trainer.devices=2`,
    as Lightning + Hydra templates choose devices) would start Lightning's own launcher behind ours: refused."""
    trainer = OmegaConf.to_container(cfg.trainer, resolve=False) if "trainer" in cfg else {}
    for key in ("accelerator", "devices", "num_nodes", "precision", "strategy"):
        if key in trainer and trainer[key] != f"${{{key}}}":
            value = trainer[key] if not isinstance(trainer[key], dict) else trainer[key].get("_target_", "...")
            instead = f"strategy={value} (a config group: conf/strategy/)" if key == "strategy" else f"{key}={value}"
            raise UserError(
                f"trainer.{key}={value}: set {instead} instead; the top-level key is the one this starter checks and"
                " launches by"
            )


def _settle_accelerator_and_devices(cfg: DictConfig) -> None:
    """Settle `accelerator` (cpu or gpu; auto: gpu where there is one) and `devices=auto|-1|[i, ...]` once, so
    workers get plain values and a device that does not exist is one line here."""
    if cfg.accelerator not in ACCELERATORS:
        raise UserError(f"accelerator={cfg.accelerator}: choose one of {', '.join(ACCELERATORS)}")
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


# full examples: begin
def _settle_shards(cfg: DictConfig) -> None:
    """A shard set's image shape and class count, when the config leaves them out (null): its shards.json."""
    if "source" not in cfg.data:
        return
    if importlib.util.find_spec("litdata") is None:
        raise UserError("data=shards needs litdata: pip install -e '.[shards]'")
    described = describe(cfg.data.source)
    for key in ("image_shape", "num_classes"):
        if cfg.data.get(key) is None:
            cfg.data[key] = described[key]


# full examples: end
def settle_num_classes(cfg: DictConfig) -> None:
    """An image folder's class count, when the config leaves it out (null): its class folders under train/."""
    if cfg.data.get("num_classes", 0) is not None or "root" not in cfg.data:
        return
    train = Path(cfg.data.root) / "train"
    if not train.is_dir():
        raise UserError(
            f"no directory {train}: data.num_classes is read from its class folders; point data.root"
            " at a tree of <root>/train/<class>/* and <root>/val/<class>/*, or give"
            " data.num_classes"
        )
    cfg.data.num_classes = sum(1 for entry in train.iterdir() if entry.is_dir())


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
    if cfg.trainer.get("gradient_clip_val") and (reason := why_not(traits.clips_gradients)) is not None:
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
    if cfg.strategy.get("cpu_offload") and device_type(cfg) == "cpu":
        raise UserError(
            f"strategy.cpu_offload=true moves {name}'s shards from GPU to CPU memory, and this run is on"
            " CPU already; leave it false"
        )
