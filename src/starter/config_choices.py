"""A config-group option that does not exist (`strategy=dpp`) is one line and exit 2 before Hydra composes anything, so
no run directory is made: the options are read off the config folders (conf/, `--config-dir`, and each
`hydra.searchpath` the command line or the primary config names). Groups none of them holds are left to Hydra."""

import importlib.resources
import sys
from pathlib import Path

from omegaconf import OmegaConf

from starter.errors import USER_ERROR_EXIT_CODE


class NoSuchOption(SystemExit):
    """Exit 2, its line said on stderr; `line` for those who tell it on (launch/nodes.py: the other nodes)."""

    def __init__(self, line: str):
        print(f"error: {line}", file=sys.stderr)
        super().__init__(USER_ERROR_EXIT_CODE)
        self.line = line


def check_choices(conf: Path, config_name: str, argv: list[str]) -> None:
    """Exit 2 with one line on stderr (NoSuchOption) where an override names an option that no config folder holds."""
    from hydra._internal.utils import get_args_parser  # Hydra's own reading of the command line (hydra-core < 1.4)
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    command, unknown = get_args_parser().parse_known_args(argv)
    if unknown:
        return  # Hydra refuses the command line and says why
    try:
        overrides = OverridesParser.create().parse_overrides(command.overrides)
    except HydraException:
        return  # Hydra says what is wrong with the syntax
    folders = config_folders(conf, command.config_name or config_name, command.config_dir, overrides)
    for override in overrides:
        group = override.key_or_group
        if override.is_delete() or group.startswith("hydra") or not any((f / group).is_dir() for f in folders):
            continue
        for option in override.sweep_string_iterator() if override.is_sweep_override() else [override.value()]:
            if (
                option is None
                or isinstance(option, str)
                and not any((f / group / f"{option}.yaml").is_file() for f in folders)
            ):
                options = sorted({p.stem for f in folders if (f / group).is_dir() for p in (f / group).glob("*.yaml")})
                given = "null" if option is None else option
                raise NoSuchOption(f"{group}={given}: no such option; choose one of {', '.join(options)}")


def config_folders(conf: Path, config_name: str, config_dir: str | None, overrides) -> list:
    folders = [conf] + ([Path(config_dir)] if config_dir else [])
    paths = [str(p) for o in overrides if o.key_or_group == "hydra.searchpath" for p in o.value()]
    for primary in (conf / f"{config_name}.yaml", conf / "hydra" / "default.yaml"):
        saved = OmegaConf.load(primary) if primary.is_file() else OmegaConf.create()
        paths += list(OmegaConf.select(saved, "hydra.searchpath") or OmegaConf.select(saved, "searchpath") or [])
    return folders + [folder for folder in map(source_folder, paths) if folder is not None]


def source_folder(spec: str):
    """The folder a config source names: `file://DIR`, `pkg://package.path` (a Traversable), or a plain directory;
    None for a package that is not installed."""
    if spec.startswith("pkg://"):
        try:
            return importlib.resources.files(spec.removeprefix("pkg://").replace("/", "."))
        except ModuleNotFoundError:
            return None
    return Path(spec.removeprefix("file://"))


def leaves(node, prefix: str = "") -> dict:
    """{"net.width": 64, ...}: the values of a nested mapping by their dotted keys."""
    if not isinstance(node, dict):
        return {prefix.rstrip("."): node}
    return {key: value for name, child in node.items() for key, value in leaves(child, f"{prefix}{name}.").items()}


def differences(mine: dict, theirs: dict, whose: str) -> str:
    """How two configs' leaves differ, as a line says it: `seed=3 (node 0: 42), ...`, the first three keys and how many
    more; "" where none does (a key one lacks differs from one holding None)."""
    absent = object()
    differ = sorted(key for key in mine.keys() | theirs.keys() if mine.get(key, absent) != theirs.get(key, absent))
    shown = ", ".join(f"{key}={mine.get(key, '(none)')} ({whose}: {theirs.get(key, '(none)')})" for key in differ[:3])
    return shown + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
