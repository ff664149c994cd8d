"""What `ckpt_path` names, and whether it can be loaded here: resolved before launch (`last`, `auto`, a path),
checked against the model before training, loaded weights-only (a checkpoint holding pickled code is refused).
"""

import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from starter.config_choices import leaves
from starter.errors import UserError, first_line
from starter.untrusted import interpolations, reading

log = logging.getLogger(__name__)
REMOTE = ("s3://", "gs://", "az://")  # a checkpoint store's prefix (checkpointing/store.py)


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
        log.info("ckpt_path=last -> %s%s", newest, sweep_job(newest.parent.parent))
        return newest
    if str(cfg.ckpt_path).startswith(REMOTE):  # a checkpoint store's prefix: its last.ckpt to resume, else its best
        from starter.checkpointing.store import CheckpointStore, fetched_for_reading

        if not cfg.train:
            return fetched_for_reading(str(cfg.ckpt_path))
        own = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
        if not CheckpointStore(str(cfg.ckpt_path)).fetch("last.ckpt", own):
            raise UserError(f"ckpt_path={cfg.ckpt_path}: no checkpoints/last.ckpt.json there to resume from")
        return own
    path = Path(cfg.ckpt_path)
    if not path.exists():  # a file, or a directory for sharded checkpoints
        raise UserError(f"ckpt_path={cfg.ckpt_path}: no such file")
    if path.is_dir() and not is_sharded(path):
        last = path / "checkpoints" / "last.ckpt"  # a run directory's
        instead = f"ckpt_path={last}" if last.is_file() else "a .ckpt file, a sharded checkpoint or ckpt_path=last"
        raise UserError(f"ckpt_path={cfg.ckpt_path} is a directory but no checkpoint; give {instead}")
    return path


def sweep_job(run: Path) -> str:
    """ " (job 2 of the sweep SWEEP: seed=3)" where `run` is a job of a sweep (its overrides, as values: never
    resolved); "" else."""
    overrides = run / ".hydra" / "overrides.yaml"
    if not ((run.parent / "multirun.yaml").is_file() and overrides.is_file()):
        return ""
    with reading(overrides, named="ckpt_path=last", part="overrides"):
        given = OmegaConf.to_container(OmegaConf.load(overrides), resolve=False)
    said = " ".join(str(o) for o in given) if isinstance(given, list) else "?"
    return f" (job {run.name} of the sweep {run.parent}: {said})"


def checkpoint_named(spec: str, log_dir: Path) -> Path:
    """The checkpoint `spec` names: a file or sharded directory; a run directory's best.ckpt, else its model.pt;
    `last`: the newest run directory under `log_dir` that has either."""
    if spec.startswith(REMOTE):  # a checkpoint store's prefix, as a run directory
        from starter.checkpointing.store import fetched_for_reading

        return fetched_for_reading(spec)
    if spec == "last":
        found = [p.parent.parent for p in log_dir.glob("**/checkpoints/*") if p.name in ("best.ckpt", "model.pt")]
        if not found:
            raise UserError(f"ckpt_path=last: no trained run under {log_dir}; train first or give a path")
        path = max(found, key=lambda run: (run / "checkpoints").stat().st_mtime)
    else:
        path = Path(spec)
    for candidate in (path / "checkpoints" / "best.ckpt", path / "checkpoints" / "model.pt"):
        if (path / "checkpoints").is_dir() and candidate.exists():
            return candidate
    if not path.exists() or path.is_dir() and not is_sharded(path):
        raise UserError(f"ckpt_path={spec}: no checkpoint there; give a .ckpt, a model.pt or a run directory")
    return path


def holds_weights_only(path: Path) -> bool:
    """A weights file (a run's model.pt: {"state_dict", "inference"}, or a plain state dict), no Lightning checkpoint
    to resume or test as one."""
    import torch

    if not path.is_file():
        return False
    with reading(path):
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return isinstance(saved, dict) and "pytorch-lightning_version" not in saved


def is_sharded(path: Path) -> bool:
    """A sharded checkpoint (fsdp, tp, pp): a directory holding Lightning's meta.pt beside the shards."""
    return path.is_dir() and (path / "meta.pt").is_file()


def saved_config(checkpoint: Path) -> DictConfig | None:
    """The config of the run that wrote `checkpoint` (<run>/checkpoints/<name>), where it is still beside it. It may be
    anyone's: read as plain YAML, never resolved. A run's config.yaml holds resolved values, so one holding an
    interpolation (`${oc.env:...}` would read this machine's environment) or no mapping is refused in one line."""
    config = checkpoint.resolve().parent.parent / "config.yaml"
    if not config.is_file():
        return None
    try:
        saved = OmegaConf.load(config)
    except Exception as err:
        raise UserError(f"{config}: refused, not a run's config.yaml ({first_line(err)})") from None
    if not isinstance(saved, DictConfig):
        raise UserError(f"{config}: refused, not a run's config.yaml (no mapping)")
    if (interpolated := next(interpolations(OmegaConf.to_container(saved, resolve=False)), None)) is not None:
        instead = "move the checkpoint out of that directory to load it without its config"
        raise UserError(f"{config}: refused, it holds an interpolation ({interpolated!r}), a run's none; {instead}")
    with reading(config, "the config beside ckpt_path", "model or strategy.name"):  # what the readers here take
        if not (OmegaConf.is_dict(saved.get("model")) and isinstance(saved.strategy.name, str)):
            raise TypeError("no mapping model or no name strategy.name")
    return saved


def check_sharded(path: Path, strategy: str) -> None:
    """A sharded checkpoint is read by the strategy that wrote it (its run's config says which), and its metadata is
    torch's (refused here, before any process starts, where it is not)."""
    if not path.is_dir():
        return
    saved = saved_config(path)
    if strategy != (writer := str(saved.strategy.name) if saved is not None else "fsdp"):
        raise UserError(
            f"ckpt_path={path} is a sharded ({writer}) checkpoint; resume or evaluate it with strategy={writer}"
        )
    from starter.checkpointing.sharded_read import read_metadata

    read_metadata(path)


def check_checkpoint_fits(model, path: Path, model_cfg: DictConfig) -> None:
    """Refuse, before training, a checkpoint whose weights do not fit this model (another net or size), naming the
    settings of the model config it was saved with that this run's (`model_cfg`) differs in, where its run says."""
    import torch

    if path.is_dir():
        return  # a sharded checkpoint: torch.distributed.checkpoint reports mismatches itself on load
    try:
        with reading(path):
            saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)["state_dict"]
    except UserError:
        raise
    except Exception as err:
        said = first_line(err).split(". ")[0]  # torch's runs on for five sentences
        beside = whole_beside(path)
        raise UserError(f"ckpt_path={path} is not a readable Lightning checkpoint ({said}){beside}") from err
    if mismatch := weights_mismatch(model.state_dict(), saved):
        run = saved_config(path)
        theirs = leaves(OmegaConf.to_container(run.model)) if run and "model" in run else {}
        mine = leaves(OmegaConf.to_container(model_cfg, resolve=True))
        differ = [f"model.{key}={value}" for key, value in theirs.items() if mine.get(key) != value]
        differ = " ".join(differ[:5] + (["..."] if len(differ) > 5 else []))
        raise UserError(
            f"ckpt_path={path} holds weights of a different model ({mismatch}); use the model config of"
            f" the run that saved it{': ' + differ if differ else ''}"
        )


def whole_beside(path: Path) -> str:
    """What a line about an unreadable checkpoint adds: the whole ones beside it, and how to start from each."""
    import zipfile

    others = sorted(p for p in path.parent.glob("*.ckpt") if p != path and p.is_file() and zipfile.is_zipfile(p))
    weights = path.parent / "model.pt"
    said = [f"ckpt_path={p} resumes from {p.name}" for p in others]
    said += [f"init_from={weights} starts afresh from its weights"] if zipfile.is_zipfile(weights) else []
    return f"; whole beside it: {', '.join(said)}" if said else "; nothing whole beside it"


def weights_mismatch(expected: dict, found: dict) -> str | None:
    """What differs between two state dicts' names and shapes, in a few words; None where nothing does."""
    shapes = {k: tuple(v.shape) for k, v in expected.items()}, {k: tuple(v.shape) for k, v in found.items()}
    if shapes[0] == shapes[1]:
        return None
    missing, unexpected = sorted(shapes[0].keys() - shapes[1].keys()), sorted(shapes[1].keys() - shapes[0].keys())
    resized = sorted(k for k in shapes[0].keys() & shapes[1].keys() if shapes[0][k] != shapes[1][k])
    found = (("missing", missing), ("unexpected", unexpected), ("other shapes", resized))
    return ", ".join(f"{what} {names[:3]}" for what, names in found if names)
