"""A Hydra callback: refuse, in one line, a run (or sweep) directory that cannot be created, or one to continue that is
not a real tree, before Hydra writes into it. A directory may be someone else's: a symlink anywhere below it would
have Hydra's writes (.hydra/), a journal's and the run's reads go elsewhere. A symlinked folder above it (logs on
scratch) is fine, and so is the link a sharded checkpoint's name is (checkpoints/last.ckpt -> a sibling)."""

import os
import time
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
                if journal_lock(entry):  # Optuna's: its stale one cleared as Optuna clears it
                    clear_if_stale(entry)
                    continue
                refuse(f"{entry} is a symlink; a run or sweep directory to continue holds none: give another one")
    for entry in [*(directory / name for name in WRITTEN), *directory.glob("*.log")]:
        if entry.exists() and not entry.is_file() and not entry.is_symlink():
            refuse(f"{entry} is not a file, and the run writes one there; a run directory to continue holds what a"
                   " run wrote: give another one")  # fmt: skip


LOCK_GRACE_S = 30  # Optuna's JournalFileSymlinkLock's default grace_period
# what a run writes there, besides <job>.log
WRITTEN = ("config.yaml", "metrics.csv", "metrics.json", "learning_curves.png", "checkpoints/model.pt",
           ".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml")  # fmt: skip


def journal_lock(entry: Path) -> bool:
    """Optuna's lock of a journal (JournalFileSymlinkLock): `<journal>.lock`, a symlink to the journal beside it."""
    target = os.path.normpath(os.path.join(entry.parent, os.readlink(entry)))
    return entry.name.endswith(".journal.lock") and target == str(entry.with_suffix("").absolute())


def clear_if_stale(lock: Path) -> None:
    """A lock whose journal has not changed for Optuna's grace period (a sweep killed while it held it) is removed,
    as Optuna would remove it after that long; a live sweep's is left to it."""
    journal = lock.with_suffix("")
    if not journal.is_file() or time.time() - journal.stat().st_mtime > LOCK_GRACE_S:
        lock.unlink()
        print(f"{lock}: a stale lock of the journal (unchanged for {LOCK_GRACE_S} s or more), removed", flush=True)


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
