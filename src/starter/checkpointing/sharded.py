"""Sharded checkpoints (directories of one file per rank) that a kill never leaves half-written: each save writes a
new directory, then the name (`last.ckpt`, `best.ckpt`) is a symlink repointed at it in one rename."""

import os
import secrets
import shutil
from pathlib import Path


def point_atomically(link: Path, target: str) -> None:
    """Make `link` a symlink to the sibling `target` with one rename, then delete older versions (half-written too)."""
    temporary = link.with_name(f".{target}.{secrets.token_hex(8)}.link")  # processes, nodes pointing it at once
    os.symlink(target, temporary)  # relative: the run directory can be moved
    if link.is_dir() and not link.is_symlink():
        shutil.rmtree(link)  # a plain sharded directory (written without this strategy)
    os.replace(temporary, link)
    for old in link.parent.glob(f"{link.name}.*"):
        if old.name != target:
            shutil.rmtree(old, ignore_errors=True)


def remove_saved(path: Path) -> None:
    """A checkpoint this run saved: its file, or its sharded name and the sibling directory that it points at. A
    symlink to anything else is removed, never followed."""
    if path.is_symlink():
        if (target := path.resolve()).parent == path.parent.resolve() and target.is_dir():
            shutil.rmtree(target, ignore_errors=True)
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
