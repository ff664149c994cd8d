"""What a healthy run prints: this starter's own lines and anything at ERROR. The rest (Lightning's notices, libraries'
warnings) goes to the run's log file; `verbose=true` prints it all."""

import logging
import sys
from pathlib import Path

from omegaconf import OmegaConf

from starter.atomic_write import unlink_symlink

FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # the log file's
ENGINE = str(Path(__file__).parents[1])  # the engine's folder: its own lines go by their logger's name


PROJECT: set[str] = set()  # the project's packages (show_project): their lines shown wherever they are installed


class Console(logging.Filter):
    """The engine's lines, the project's (its package, installed as a library or not, and any code outside the
    installed libraries and Python's own), and anything at ERROR; but those marked `extra={"file_only": True}` (or by
    file_only)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "file_only", False):
            return False
        if record.name.startswith("starter") or record.levelno >= logging.ERROR or record.name.split(".")[0] in PROJECT:
            return True
        return not (record.pathname.startswith(ENGINE) or library(record.pathname))  # the engine's go by name


def library(path: str) -> bool:
    """Whether `path` is the code of an installed library or of Python itself."""
    import sysconfig

    places = {sysconfig.get_paths()[key] for key in ("purelib", "platlib", "stdlib", "platstdlib")}
    return path.startswith(tuple(places)) or "site-packages" in path or "dist-packages" in path


def file_only(record: logging.LogRecord) -> bool:
    """A logger's filter: its records go to the run's log only (a library's errors that the starter handles and says
    in a line of its own)."""
    record.file_only = True
    return True


class RunLog(logging.FileHandler):
    """The run's log file, appended to; where its entry is a symlink, a file of its own instead."""

    def _open(self):
        unlink_symlink(self.baseFilename)
        return super()._open()


def show_project(cfg) -> None:
    """The project's packages: those the config's model and data come from, the engine's not."""
    targets = (OmegaConf.select(cfg, key) for key in ("model._target_", "data._target_"))
    PROJECT.update(str(t).split(".")[0] for t in targets if t and not str(t).startswith("starter."))


def set_up_logging(log_file: Path | None, console_level: int = logging.INFO, verbose: bool = False) -> None:
    """A process's logging as a Hydra job's (conf/hydra/default.yaml): for launched workers, and ranks other than 0
    (`console_level` WARNING: rank 0 alone speaks)."""
    root = logging.getLogger()
    for handler in root.handlers[:]:
        root.removeHandler(handler)
    console = logging.StreamHandler(sys.stdout)  # as Hydra's console handler: the run's own lines on stdout
    console.setLevel(console_level)
    if not verbose:
        console.addFilter(Console())
    root.addHandler(console)
    if log_file is not None:
        file = RunLog(log_file)
        file.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(file)
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)
