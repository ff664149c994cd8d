"""A Hydra callback: refuse, in one line, a run directory that cannot be created, before Hydra tries to."""

import os
import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback


def check_writable(directory: str) -> None:
    path = Path(directory).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if existing.is_dir() and os.access(existing, os.W_OK | os.X_OK):
        return
    problem = "is not a directory" if not existing.is_dir() else "is not writable"
    print(f"error: cannot write the run directory {path}: {existing} {problem}; set paths.log_dir", file=sys.stderr)
    raise SystemExit(2)


class CheckOutputDir(Callback):
    def on_run_start(self, config, **kwargs) -> None:
        HydraConfig.instance().set_config(config)  # as Hydra does next: lets ${hydra:...} in paths resolve
        check_writable(config.hydra.run.dir)

    def on_multirun_start(self, config, **kwargs) -> None:
        HydraConfig.instance().set_config(config)
        check_writable(config.hydra.sweep.dir)
