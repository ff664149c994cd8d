"""Every decision made before anything heavy is imported or any process started: `prepare(cfg)` settles the
composed config in place (accelerator, devices, class count, checkpoint path), computes the process layout, and
checks what the run asks for against what the strategy declares it can do (its traits). Anything a user can get
wrong fails here, in one line. torch is imported for one decision only: how many GPUs this machine has.
"""

import logging
from pathlib import Path

from omegaconf import DictConfig, ListConfig

from starter.checkpointing.resume import check_sharded_writer, resolve_ckpt_path, saved_config
from starter.errors import UserError
from starter.launch.environment import adopt_torchrun_sizes, check_rendezvous, cuda_device_count, external_launcher
from starter.topology import PIPELINE_SCHEDULES, Layout, device_count, pipeline_cut, stages_per_process
from starter.traits import Traits, why_not

log = logging.getLogger(__name__)

PRECISIONS = ("32", "16-mixed", "bf16-mixed", "bf16-true")
ACCELERATORS = ("auto", "cpu", "gpu", "cuda")
TENSOR_PARALLEL_NETS = ("MLP", "ViT")  # class names of the nets whose layers strategies/tp.py splits


def prepare(cfg: DictConfig) -> Layout:
    """Validate `cfg`, settle it in place, and return the layout of its processes."""
    adopt_torchrun_sizes(cfg)
    if str(cfg.precision) not in PRECISIONS:
        raise UserError(f"precision={cfg.precision}: choose one of {', '.join(PRECISIONS)}")
    _check_stop_signals(cfg)
    for key, default in (("heartbeat_timeout_s", 120), ("stall_timeout_s", 600)):
        if not float(cfg[key]) > 0:
            raise UserError(f"{key}={cfg[key]}: give seconds above 0 (default {default})")
    _settle_accelerator_and_devices(cfg)
    _settle_num_classes(cfg)
    if device_count(cfg.devices) < 1 or int(cfg.num_nodes) < 1:
        raise UserError(f"devices={cfg.devices}, num_nodes={cfg.num_nodes}: both must be at least 1")
    traits = Traits.of(cfg.strategy)
    _check_processes(cfg, traits)
    layout = Layout.of(cfg)
    _check_capabilities(cfg, traits, layout)
    _check_tensor_parallel_net(cfg, layout)
    if traits.pipeline or layout.pipeline_parallel > 1:
        _check_pipeline(cfg, layout)
    _check_fixed_input_size(cfg)
    _check_logger_packages(cfg)
    layout.batch_per_process(int(cfg.data.batch_size))
    if traits.multi_process and not external_launcher(layout.world):
        check_rendezvous(layout.nodes)
    if cfg.ckpt_path is not None:
        path = resolve_ckpt_path(cfg)
        if path is not None:
            check_sharded_writer(path, cfg.strategy.name)
            if cfg.train and path.is_dir():
                _check_pipeline_cut(cfg, layout, path)
        cfg.ckpt_path = None if path is None else str(path)
    return layout


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


def _check_processes(cfg: DictConfig, traits: Traits) -> None:
    """A strategy of one process runs on one node, and on one device unless it drives them all (dp, on GPUs)."""
    name, devices = cfg.strategy.name, device_count(cfg.devices)
    if traits.multi_process:
        return
    if int(cfg.num_nodes) > 1:
        raise UserError(f"strategy={name} is one process on one machine; use strategy=ddp for several nodes")
    if traits.devices_per_process == "one" and devices > 1:
        raise UserError(f"strategy={name} runs one process on one device, but devices={devices}; "
                        f"use strategy=ddp (or ddp_spawn) for {devices} processes")  # fmt: skip
    if devices > 1 and runs_on_cpu(cfg):
        raise UserError(f"strategy={name} splits each batch over CUDA GPUs and this run is on CPU; "
                        f"use strategy=ddp devices={devices} for {devices} CPU processes")  # fmt: skip
    if traits.devices_per_process == "all" and devices == 1:
        log.info("strategy=%s with devices=1 is single-device training: there is nothing to split", name)


def _check_capabilities(cfg: DictConfig, traits: Traits, layout: Layout) -> None:
    """What the run asks for against what the strategy declares (conf/strategy/<name>.yaml, `traits`)."""
    name = cfg.strategy.name
    if cfg.get("compile") and (reason := why_not(traits.compiles)) is not None:
        raise UserError(f"compile=true with strategy={name}: {reason or 'not supported'}; use strategy=ddp"
                        " (or strategy=auto on one device)")  # fmt: skip
    if cfg.precision == "16-mixed" and (reason := why_not(traits.scales_fp16)) is not None:
        raise UserError(f"strategy={name} cannot scale fp16 losses (16-mixed): {reason or 'not supported'};"
                        " use precision=bf16-mixed")  # fmt: skip
    if cfg.trainer.get("gradient_clip_val") and (reason := why_not(traits.clips_gradients)) is not None:
        raise UserError(f"trainer.gradient_clip_val with strategy={name}: {reason or 'not supported'}; leave"
                        " gradient clipping off")  # fmt: skip
    if cfg.model.get("ema_decay") is not None and not traits.whole_weights:
        raise UserError(f"model.ema_decay (weight averaging) needs whole weights in each process; strategy="
                        f"{name} shards them. Use strategy=ddp, or model.ema_decay=null")  # fmt: skip
    if cfg.get("sync_batchnorm") and layout.world > 1:
        if not traits.syncs_batchnorm:
            raise UserError(f"sync_batchnorm=true is for strategy=ddp or ddp_spawn, not strategy={name}")
        if runs_on_cpu(cfg):
            raise UserError("sync_batchnorm=true needs GPUs: torch's SyncBatchNorm does not run on CPU (gloo);"
                            " on CPU each process normalises with its own batch statistics")  # fmt: skip
    if cfg.strategy.get("cpu_offload") and runs_on_cpu(cfg):
        raise UserError(f"strategy.cpu_offload=true moves {name}'s shards from GPU to CPU memory, and this run is on"
                        " CPU already; leave it false")  # fmt: skip


def _check_tensor_parallel_net(cfg: DictConfig, layout: Layout) -> None:
    """Tensor parallel splits Linear layers of known shapes: the net must have them, in sizes that split."""
    tp = layout.tensor_parallel
    if tp == 1:
        return
    net = str(cfg.model.net.get("_target_", "")).rsplit(".", 1)[-1]
    if net not in TENSOR_PARALLEL_NETS:
        raise UserError(f"strategy={cfg.strategy.name} splits the Linear layers of model=mlp or model=vit; this"
                        f" model's net ({net}) has none it can split; use strategy=fsdp or ddp for it")  # fmt: skip
    for key in ("heads", "width"):
        if key in cfg.model.net and int(cfg.model.net[key]) % tp:
            raise UserError(f"model.net.{key}={cfg.model.net[key]} does not split over {tp} tensor-parallel"
                            f" processes; use a multiple of {tp}")  # fmt: skip


def _check_pipeline(cfg: DictConfig, layout: Layout) -> None:
    """A pipeline runs each process's batch as micro-batches through its stages, by a schedule that fits them."""
    strategy, stages = cfg.strategy, layout.pipeline_parallel
    if cfg.get("compile"):
        raise UserError("compile=true with a pipeline: the pipeline schedule runs the stages; use strategy=ddp or"
                        " fsdp without strategy.pipeline_parallel_size")  # fmt: skip
    schedule, micro = str(strategy.schedule), int(strategy.microbatches)
    if schedule not in PIPELINE_SCHEDULES:
        raise UserError(f"strategy.schedule={schedule}: choose one of {', '.join(PIPELINE_SCHEDULES)}")
    per_process = stages_per_process(schedule, strategy.get("stages_per_rank"))
    if (schedule == "interleaved_1f1b") != (per_process > 1):
        fix = (
            "strategy.stages_per_rank=2 (or more)"
            if schedule == "interleaved_1f1b"
            else "strategy.schedule=interleaved_1f1b"
        )
        raise UserError(f"strategy.schedule={schedule} with strategy.stages_per_rank={per_process}: gpipe and 1f1b run"
                        f" one stage per process, interleaved_1f1b several; use {fix}")  # fmt: skip
    batch = layout.batch_per_process(int(cfg.data.batch_size))
    if batch % micro:
        raise UserError(
            f"data.batch_size={cfg.data.batch_size} gives each pipeline {batch} samples a step, which"
            f" strategy.microbatches={micro} does not divide; give each pipeline a multiple of {micro}"
        )
    if schedule == "1f1b" and micro < stages:
        raise UserError(f"strategy.microbatches={micro} is fewer than the {stages} stages of the pipeline, which 1f1b"
                        f" needs at least; use strategy.microbatches={stages} or more")  # fmt: skip
    if schedule == "interleaved_1f1b" and micro % max(1, micro // stages):
        raise UserError(f"strategy.microbatches={micro}: interleaved_1f1b on {stages} processes needs a multiple"
                        f" of {stages}")  # fmt: skip


def _check_stop_signals(cfg: DictConfig) -> None:
    import signal

    if unknown := [name for name in cfg.get("stop_signals") or [] if name not in signal.Signals.__members__]:
        raise UserError(f"stop_signals: {', '.join(map(str, unknown))} is no signal here; use names such as SIGTERM,"
                        " SIGUSR1, SIGUSR2")  # fmt: skip


def _check_pipeline_cut(cfg: DictConfig, layout: Layout, path: Path) -> None:
    """A pipeline's sharded checkpoint holds each stage's optimizer state: training continues with the same cut."""
    saved = saved_config(path)
    if saved is None:
        return
    was, asked = pipeline_cut(saved.strategy, Layout.of(saved)), pipeline_cut(cfg.strategy, layout)
    if was != asked:
        raise UserError(f"ckpt_path={path} was saved by {_describe_cut(was)}; this run asks for {_describe_cut(asked)}:"
                        " resume it with the strategy.pipeline_parallel_size and strategy.stages_per_rank it was"
                        " saved with (evaluating it works: train=false)")  # fmt: skip


def _describe_cut(cut: tuple[int, int] | None) -> str:
    if cut is None:
        return "a net not cut into a pipeline"
    return f"a pipeline of {cut[0]} processes x {cut[1]} stages each"


def _check_fixed_input_size(cfg: DictConfig) -> None:
    """A net built for one image size (a ViT's position embedding) must get that size in training and evaluation."""
    size = cfg.model.net.get("image_size")
    crops = {key: cfg.data.get(key) for key in ("train_crop_size", "val_crop_size")}
    if size is None or all(crop in (None, size) for crop in crops.values()):
        return
    given = ", ".join(f"data.{key}={crop}" for key, crop in crops.items() if crop not in (None, size))
    raise UserError(f"the net takes {size}x{size} images only (model.net.image_size, from data.image_shape) "
                    f"but {given}; use {size}, or change data.image_shape")  # fmt: skip


def _check_logger_packages(cfg: DictConfig) -> None:
    import importlib.util

    extras = {"mlflow": "loggers", "wandb": "loggers", "tensorboard": "tensorboard"}
    modules = {"tensorboard": ("tensorboard", "tensorboardX")}  # Lightning's TensorBoardLogger takes either
    for name in cfg.get("logger") or {}:
        if name in extras and not any(importlib.util.find_spec(m) for m in modules.get(name, (name,))):
            raise UserError(f"logger={name} needs the {name} package: pip install -e '.[{extras[name]}]'"
                            f" (or pip install {name})")  # fmt: skip
