"""Every file a run writes into its directory is a new file renamed over the entry: a kill never leaves it truncated,
and a symlink there (a run directory may be someone else's) is replaced, never followed."""

import errno
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

from starter.errors import UserError, causes, interrupted


@contextmanager
def replacing(path, mode: str = "w", **open_args):
    """A file object to write `path`'s new contents to: a temporary file beside it, synced and renamed over `path`
    when the block ends (removed where it raises)."""
    path = Path(path)
    with room_for(path):
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


@contextmanager
def room_for(path):
    """A write of `path` that fails for want of room (a full disk, a quota) is one line naming it: what was saved
    before is whole, as every save writes a new file (or directory) and renames it into place. A write that Ctrl-C cut
    short is not one: torch's zip writer then says the lost bytes' error as a full disk does."""
    try:
        yield
    except BaseException as err:  # torch's CheckpointException is one
        if interrupted() or any(isinstance(e, KeyboardInterrupt) for e in causes(err)) or not out_of_room(err):
            raise
        if limit := size_limit(path):
            raise UserError(
                f"the file size limit (ulimit -f: {limit} bytes) was reached writing {path}; what was saved before is"
                " whole: raise it (ulimit -f unlimited) and resume with ckpt_path=auto"
            ) from None
        raise UserError(
            f"no space left on device writing {path}; what was saved before is whole: make room and resume with"
            " ckpt_path=auto"
        ) from None


def size_limit(path: Path) -> int | None:
    """This process's file size limit (RLIMIT_FSIZE, `ulimit -f`) where it, not the disk, stopped a write to `path`:
    the disk beside it has more room than the limit. Python ignores the signal it sends, so the write fails EFBIG
    (or torch's zip writer finds its bytes lost)."""
    import resource
    import shutil

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit == resource.RLIM_INFINITY:
        return None
    try:
        return limit if shutil.disk_usage(Path(path).parent).free > limit else None
    except OSError:
        return limit


def out_of_room(err: BaseException | None) -> bool:
    """Whether `err` (or what it was raised from: torch's writer says a RuntimeError after the OSError; a sharded
    save, each rank's failure) is ENOSPC, EDQUOT or EFBIG, or torch's zip writer finding bytes it wrote lost (a buffered
    write to a full disk: "unexpected pos", the OSError swallowed)."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return True
    if isinstance(err, RuntimeError) and "inline_container" in str(err) and "unexpected pos" in str(err):
        return True
    failures = [failure[0] for failure in getattr(err, "failures", {}).values()]  # torch's CheckpointException
    return err is not None and any(map(out_of_room, [err.__cause__ or err.__context__, *failures]))


def unlink_symlink(path) -> None:
    """A file the run appends to (its log, metrics.csv) starts anew where the entry is a symlink: never followed."""
    if os.path.islink(path):
        os.unlink(path)
