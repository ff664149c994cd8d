"""Every file the starter reads may be someone else's: a checkpoint, a run directory, a shard set, a sweep's journal.
The rule, one for every reader: a file supplies *values*, never code, URLs or paths to read or write. Each reader
accepts only what this starter writes and refuses the rest in one line, before anything is unpickled, instantiated
or resolved (docs/guarantees.md names each reader and what it accepts). Every reader parses inside `reading`: what a
file's content breaks is one line naming the file and the part, never a traceback. A path that a file or a restored
state names is used only inside this run's own folder (`inside`), and a value is checked for what it means.

Where a file's content becomes config (a checkpoint's inference record rebuilding its model), it is rebuilt here from
what the model configs of *this* checkout declare: a `_target_` (and `_partial_`, `_convert_`, `_recursive_`) only
as a config here declares it at that place; other keys only where a config declares them, each a plain value (no
interpolation, no URL or path), a key no config declares left out (said in the log); `_args_` never. What fetches or
reads weights is switched off: the checkpoint's own weights are loaded after the build."""

import csv
import logging
import math
import os
import pickle
import re
from contextlib import contextmanager
from pathlib import Path

from omegaconf import OmegaConf

from starter.config_choices import source_folder
from starter.errors import UserError, first_line

log = logging.getLogger(__name__)
SPECIAL = ("_target_", "_partial_", "_convert_", "_recursive_")  # taken as a config here declares them
OFF = {"pretrained": False, "weights": None}  # a builder that would fetch weights builds without them
READS = {"cache_dir", "checkpoint_path", "pretrained_cfg", "pretrained_cfg_overlay", "pretrained_cfg_overlay_file"}
SCALARS = (type(None), bool, int, float, str)
MAPPING = object()  # declared as a mapping (its keys declared below it)
# what parsing a malformed file raises: a key missing, a value of another type or out of range, a file cut short
MALFORMED = (KeyError, IndexError, TypeError, ValueError, AttributeError, EOFError, OverflowError, csv.Error)


@contextmanager
def reading(path, named: str = "ckpt_path", part: str = ""):
    """Around the parsing of a file that may be anyone's (the user's `named`=`path`): a pickled object in it (code that
    would run) or a value its parsing cannot take (MALFORMED) is one line naming the file and `part`."""
    try:
        yield
    except pickle.UnpicklingError as err:
        first = first_line(err, named=False)[:120]
        refused = "refused: loading it could run code. Load only checkpoints written by this starter"
        raise UserError(f"{named}={path} holds pickled objects besides tensors ({first}...); {refused}") from None
    except MALFORMED as err:
        what, why = f"its {part}" if part else "its content", first_line(err)[:160]
        raise UserError(f"{named}={path}: {what} is malformed ({why}); use one this starter wrote") from None


def inside(path, folder, named: str) -> str:
    """A path that a file or a restored state names (`named`: which, and its key), relative to `folder` (this run's
    own) or absolute: used only where it lies inside `folder`, `..` and symlinks resolved; else dropped ("") with one
    line."""
    folder = Path(folder).resolve()
    joined = Path(os.path.normpath(folder / path)) if path else folder
    if joined != folder and joined.is_relative_to(folder) and joined.resolve().is_relative_to(folder):
        return str(joined)
    if path:
        log.warning("%s names %s, outside %s: dropped (a file names nothing outside its run)", named, path, folder)
    return ""


def formula_safe(cell: str) -> str:
    """A CSV cell that a spreadsheet shows as text: one that would start a formula gets a leading apostrophe."""
    return f"'{cell}" if cell[:1] in ("=", "+", "-", "@", "\t", "\r") else cell


def check_image_record(record: dict, named: str) -> None:
    """What an image classifier's inference record means, checked (it prepares every image and names every class):
    a shape of positive sizes within reason, a finite positive value range, a finite mean and a positive finite std
    per channel, class names of plain text."""
    with reading(named.partition("=")[2], named.partition("=")[0], "inference record"):
        shape, mean, std = [int(n) for n in record["image_shape"]], record["mean"], record["std"]
        finite = [float(v) for v in (*mean, *std, record["value_range"])]
        problem = (
            "image_shape is no (channels, height, width) of positive sizes up to 64 x 16384 x 16384"
            if len(shape) != 3 or not (0 < shape[0] <= 64 and all(0 < n <= 16384 for n in shape[1:]))
            else "mean, std and value_range are not finite numbers, with std and value_range above 0"
            if not all(map(math.isfinite, finite)) or min(*map(float, std), float(record["value_range"])) <= 0
            else "mean and std do not give one number per channel"
            if not len(mean) == len(std) == shape[0]
            else "classes are not names of plain text"
            if not all(type(c) is str and c.isprintable() for c in record["classes"])
            else None
        )
    if problem:
        raise UserError(f"{named}: its inference record is malformed ({problem}); use one this starter wrote")


def model_config_dirs() -> list[str]:
    """The config folders of this Hydra run (conf/ and each `hydra.searchpath`): their model/ configs say what a
    checkpoint's record may rebuild."""
    from hydra.core.hydra_config import HydraConfig

    sources = HydraConfig.get().runtime.config_sources
    folders = (source_folder(f"{s.schema}://{s.path}") for s in sources if s.schema in ("file", "pkg"))
    return [str(folder) for folder in folders if folder is not None]


def declared_models(config_dirs) -> dict[tuple, list]:
    """What the model configs of `config_dirs` declare at each place (a key path inside `model`): the values they
    give there, MAPPING for a mapping. Experiments' `model:` blocks declare too (they patch a model config)."""
    declared: dict[tuple, list] = {}
    for folder in map(Path, config_dirs):
        for config in sorted((folder / "model").rglob("*.yaml")):
            _declare(_yaml(config), (), declared)
        for experiment in sorted((folder / "experiment").rglob("*.yaml")):
            if isinstance(model := _yaml(experiment).get("model"), dict):
                _declare(model, (), declared)
    return declared


def model_config(record, declared: dict[tuple, list], named: str) -> dict:
    """The model config that a checkpoint's inference record (`record["model"]`) asks for, rebuilt from what
    `declared` allows (see the module's docstring); anything else refused in one line. `named`: how the user named
    the checkpoint (`ckpt_path=...`)."""
    if not isinstance(record, dict) or not isinstance(record.get("model"), dict):
        raise UserError(f"{named}: its inference record holds no model config; use a checkpoint this starter trained")
    for place, target in _targets(record["model"], ()):
        if not isinstance(target, str) or target not in declared.get((*place, "_target_"), ()):
            raise UserError(
                f"{named}: its inference record names {target!r}, which no model config here names"
                " (conf/model/ and hydra.searchpath); refused: loading a checkpoint never calls what it names. Give"
                " the run's hydra.searchpath, or use a checkpoint this starter trained"
            )
    if interpolated := next(interpolations(record), None):
        raise UserError(
            f"{named}: its inference record holds an interpolation ({interpolated!r}); refused: a trained"
            " model's record holds plain values"
        )
    return _rebuilt(record["model"], (), declared, named)


def _rebuilt(node: dict, place: tuple, declared: dict, named: str) -> dict:
    config = {}
    for key, value in node.items():
        here, shown = (*place, key), ".".join(map(str, ("model", *place, key)))
        if key in OFF:
            config[key] = OFF[key]
        elif key in READS:
            continue
        elif key in SPECIAL and value in declared.get(here, ()) and type(value) in SCALARS:
            config[key] = value
        elif not isinstance(key, str) or key in SPECIAL or key == "_args_":
            raise UserError(f"{named}: its inference record sets {shown}, which no model config here declares; {ONLY}")
        elif here not in declared:  # e.g. +model.optimizer.foreach=true at training: a setting inference needs not
            log.info("%s: its inference record's %s is declared by no model config here: left out", named, shown)
        elif isinstance(value, dict) and MAPPING in declared[here]:
            config[key] = _rebuilt(value, here, declared, named)
        elif plain(value) and not _located(value) and _of_declared_type(value, declared[here]):
            config[key] = value
        else:
            raise UserError(
                f"{named}: its inference record sets {shown}={value!r}, which is no plain value of the type declared"
                f" there (nor a URL or path); {ONLY}"
            )
    return config


ONLY = "a record supplies plain values for what the model configs here declare (use a checkpoint this starter trained)"


def plain(value) -> bool:
    """A scalar of exactly a plain type (no subclass: numpy's float64, an Enum), or a list of such."""
    if isinstance(value, (list, tuple)):
        return all(map(plain, value))
    return type(value) in SCALARS


def _located(value) -> bool:
    """Whether a value names a URL or a path (something a builder would fetch or read)."""
    if isinstance(value, (list, tuple)):
        return any(map(_located, value))
    return isinstance(value, str) and any(mark in value for mark in ("/", "\\", ":"))


def _of_declared_type(value, declared: list) -> bool:
    """Whether `value` has the type of a value declared at its place, where every one declared is a plain value
    (an interpolation, `???` or null declares no type); an int stands for a float."""
    given = [v for v in declared if type(v) in SCALARS and v is not None and not str(v).startswith(("${", "???"))]
    if len(given) < len(declared) or not given:
        return True
    kinds = {type(v) for v in given} | ({int} if float in map(type, given) else set())
    return all(type(v) in kinds for v in value) if isinstance(value, (list, tuple)) else type(value) in kinds


def interpolations(node):
    """Every string in `node` (keys too) that OmegaConf would resolve (`\\${` is the text `${`)."""
    return (n for n in _nodes(node) if isinstance(n, str) and re.search(r"(?<!\\)\$\{", n))


def _declare(node, place: tuple, declared: dict) -> None:
    for key, value in node.items():
        if place or key != "defaults":
            here = (*place, key)
            declared.setdefault(here, []).append(MAPPING if isinstance(value, dict) else value)
            if isinstance(value, dict):
                _declare(value, here, declared)


def _targets(node, place: tuple):
    """(place, `_target_`) of every mapping in `node`, at any depth (inside lists too: their place is the list's)."""
    if isinstance(node, dict):
        if "_target_" in node:
            yield place, node["_target_"]
        for key, value in node.items():
            yield from _targets(value, (*place, key))
    elif isinstance(node, (list, tuple)):
        for item in node:
            yield from _targets(item, place)


def _yaml(path: Path) -> dict:
    config = OmegaConf.to_container(OmegaConf.create(path.read_text()))
    return config if isinstance(config, dict) else {}


def _nodes(node):
    """`node` and everything inside it: mappings' keys and values, lists' items."""
    yield node
    inside = (
        [*node.keys(), *node.values()] if isinstance(node, dict) else node if isinstance(node, (list, tuple)) else ()
    )
    for child in inside:
        yield from _nodes(child)
