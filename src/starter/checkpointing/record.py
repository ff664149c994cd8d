"""What a checkpoint's inference record may name. The record rebuilds the model it holds weights for; so that loading a
checkpoint never calls what the checkpoint chooses, every `_target_` in it, at any depth, must be one that a model
config here names (the model/ folder of each config source: this repository's conf/ and each `hydra.searchpath`),
and every value plain (no interpolation, which would run a resolver). The checkpoint supplies values only."""

from pathlib import Path

from omegaconf import OmegaConf

from starter.config_choices import source_folder
from starter.errors import UserError


def model_builders(config_dirs: list[Path] | None = None) -> set[str]:
    """The `_target_`s that the model configs of this Hydra run's config sources name (or of `config_dirs`)."""
    builders = set()
    for folder in [Path(d) / "model" for d in config_dirs] if config_dirs is not None else _source_model_folders():
        if folder.is_dir():
            for config in _yaml_files(folder):
                builders |= set(_targets(OmegaConf.to_container(OmegaConf.create(config.read_text()))))
    return builders


def check_record(record, builders: set[str], named: str) -> None:
    """Refuse, in one line, a record that names anything but `builders`, or holds an interpolation. `named`: how the
    user named the checkpoint (`ckpt_path=...`, `init_from=...`)."""
    for target in _targets(record):
        if not isinstance(target, str) or target not in builders:
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


def _source_model_folders():
    from hydra.core.hydra_config import HydraConfig

    for source in HydraConfig.get().runtime.config_sources:
        if source.schema in ("file", "pkg") and (folder := source_folder(f"{source.schema}://{source.path}")):
            yield folder / "model"


def _yaml_files(folder):
    for entry in folder.iterdir():
        if entry.is_dir():
            yield from _yaml_files(entry)
        elif entry.name.endswith(".yaml"):
            yield entry


def _targets(node):
    """The `_target_` of every mapping in `node`, at any depth."""
    return (n["_target_"] for n in _nodes(node) if isinstance(n, dict) and "_target_" in n)


def interpolations(node):
    """Every string in `node` (keys too) that OmegaConf would resolve."""
    return (n for n in _nodes(node) if isinstance(n, str) and "${" in n)


def _nodes(node):
    """`node` and everything inside it: mappings' keys and values, lists' items."""
    yield node
    inside = (
        [*node.keys(), *node.values()] if isinstance(node, dict) else node if isinstance(node, (list, tuple)) else ()
    )
    for child in inside:
        yield from _nodes(child)
