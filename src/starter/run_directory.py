"""A Hydra callback: refuse, in one line, a run (or sweep) directory that cannot be created, or one to continue that is
not a real tree, before Hydra writes into it. A directory may be someone else's: a symlink anywhere below it would
have Hydra's writes (.hydra/), a journal's and the run's reads go elsewhere. A symlinked folder above it (logs on
scratch) is fine, and so is the link a sharded checkpoint's name is (checkpoints/last.ckpt -> a sibling)."""

import os
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback

from starter.errors import to_stderr


def check_writable(directory: str) -> None:
    path = Path(directory).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if existing.is_dir() and os.access(existing, os.W_OK | os.X_OK):
        return check_real_tree(path)
    problem = "is not a directory" if not existing.is_dir() else "is not writable"
    refuse(f"cannot write the run directory {path}: {existing} {problem}; set paths.log_dir")


def check_real_tree(directory: Path) -> None:
    for folder, folders, files in os.walk(directory):
        for name in [*folders, *files]:
            entry = Path(folder) / name
            if entry.is_symlink() and not (Path(folder).name == "checkpoints" and sibling(os.readlink(entry))):
                refuse(f"{entry} is a symlink; a run or sweep directory to continue holds none: give another one")


def sibling(target: str) -> bool:
    return os.sep not in target and target not in (".", "..")


def refuse(line: str) -> None:
    to_stderr(f"error: {line}")
    raise SystemExit(2)


class CheckOutputDir(Callback):
    def on_run_start(self, config, **kwargs) -> None:
        HydraConfig.instance().set_config(config)  # as Hydra does next: lets ${hydra:...} in paths resolve
        check_writable(config.hydra.run.dir)

    def on_multirun_start(self, config, **kwargs) -> None:
        HydraConfig.instance().set_config(config)
        check_writable(config.hydra.sweep.dir)
