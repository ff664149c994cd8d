"""A checkpoint continued, resumed or evaluated on the split it was trained on. A DataModule declares the arguments that
draw its split (`split_by`: digits' seed and fractions); each checkpoint records them (`data_split`, with the
DataModule's class), and a run from it takes them where its command line does not give them, said in a line; one that
gives another value is refused, naming both: its test samples would be among the checkpoint's training samples."""

import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from starter.errors import UserError
from starter.untrusted import reading

log = logging.getLogger(__name__)
KEY = "data_split"  # in a checkpoint (a sharded one's meta.pt): {"_target_": class, "data.<name>": value, ...}


def record(datamodule) -> dict:
    """What a checkpoint records of `datamodule`'s split; {} where it declares none."""
    names = getattr(datamodule, "split_by", ())
    if not names:
        return {}
    kind = type(datamodule)
    values = {f"data.{name}": getattr(datamodule, name) for name in names}
    return {"_target_": f"{kind.__module__}.{kind.__qualname__}"} | {k: _plain(v) for k, v in values.items()}


def settle_split(cfg: DictConfig, path: Path, given: list[str]) -> None:
    """`cfg.data` on the split the checkpoint at `path` was trained on (`given`: the command line's overrides)."""
    saved = recorded(path)
    if not saved or saved.pop("_target_", None) != cfg.data.get("_target_"):
        return  # none recorded (an older checkpoint, a DataModule that declares none), or another data set chosen
    config = OmegaConf.to_container(cfg, resolve=False)
    for key, value in saved.items():
        mine = OmegaConf.select(cfg, key)
        if _plain(mine) == value:
            continue
        if _given(key, config, given):
            raise UserError(
                f"ckpt_path={path} was trained on the split {key}={value} draws; this run gives {key}={_plain(mine)}:"
                f" its test samples would be among the checkpoint's training samples; give {key}={value}, or no {key}"
            )
        with open_dict(cfg):
            OmegaConf.update(cfg, key, value)
        log.info("%s=%s: the split ckpt_path=%s was trained on (its record)", key, value, path)


def recorded(path: Path) -> dict:
    """The checkpoint's record, each value checked: a number, a flag, or a list of them (a file supplies values)."""
    import torch

    with reading(path, part=KEY):
        try:
            saved = torch.load(path / "meta.pt" if path.is_dir() else path, "cpu", weights_only=True, mmap=True)
        except (RuntimeError, OSError, EOFError):
            return {}  # unreadable: said before training, naming what is whole beside it (resume.py)
        found = (saved.get(KEY) or {}) if isinstance(saved, dict) else {}
        for key, value in found.items():
            plain = isinstance(value, (bool, int, float)) or (
                isinstance(value, list) and all(isinstance(v, (bool, int, float)) for v in value)
            )
            if not (key == "_target_" and isinstance(value, str) or key.startswith("data.") and plain):
                raise ValueError(f"{key}={value!r} is no split setting")
    return dict(found)


def _given(key: str, config: dict, given: list[str]) -> bool:
    """Whether the command line sets `key`, or the key it takes its value from (`data.seed: ${seed}`)."""
    names = {o.lstrip("+~").split("=", 1)[0] for o in given}
    node = config
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    source = node[2:-1] if isinstance(node, str) and node.startswith("${") and node.endswith("}") else None
    return key in names or source in names


def _plain(value):
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=True)
    return list(value) if isinstance(value, (list, tuple)) else value
