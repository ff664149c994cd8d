"""A logger built on rank 0 only, which alone logs: Lightning's MLFlowLogger opens its tracking store in its
constructor, in every rank, and two ranks creating one SQLite store at once made one die in its schema migration
("duplicate column name: step"). The other ranks get none (run.py leaves out a logger that builds to None)."""

import os

from hydra.utils import get_class


def on_rank_zero(logger: str, **kwargs):
    """`logger` (a class path) built with `kwargs` on rank 0; None on the others."""
    if int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0))) != 0:
        return None
    return get_class(logger)(**kwargs)
