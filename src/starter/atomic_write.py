"""Every file a run writes into its directory is a new file renamed over the entry: a kill never leaves it truncated,
and a symlink there (a run directory may be someone else's) is replaced, never followed."""

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def replacing(path, mode: str = "w", **open_args):
    """A file object to write `path`'s new contents to: a temporary file beside it, synced and renamed over `path`
    when the block ends (removed where it raises)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would keep the run's files from the people it is shared with
        with os.fdopen(fd, mode, **open_args) as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def unlink_symlink(path) -> None:
    """A file the run appends to (its log, metrics.csv) starts anew where the entry is a symlink: never followed."""
    if os.path.islink(path):
        os.unlink(path)
