"""Sharded checkpoints (directories of one file per rank) that a kill never leaves half-written: each save writes a
new directory, then the name (`last.ckpt`, `best.ckpt`) is a symlink repointed at it in one rename."""

import os
import shutil
from pathlib import Path


def point_atomically(link: Path, target: str) -> None:
    """Make `link` a symlink to the sibling `target` with one rename, then delete older versions (half-written too)."""
    temporary = link.with_name(f".{target}.link")
    os.symlink(target, temporary)  # relative: the run directory can be moved
    if link.is_dir() and not link.is_symlink():
        shutil.rmtree(link)  # a plain sharded directory (written without this strategy)
    os.replace(temporary, link)
    for old in link.parent.glob(f"{link.name}.*"):
        if old.name != target:
            shutil.rmtree(old, ignore_errors=True)
