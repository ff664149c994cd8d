"""A logger built on rank 0 only, which alone logs: Lightning's MLFlowLogger opens its tracking store in its
constructor, in every rank, and two ranks creating one SQLite store at once made one die in its schema migration
("duplicate column name: step"). The other ranks get none (run.py leaves out a logger that builds to None)."""

from hydra.utils import get_class

from starter.topology import process_rank


def on_rank_zero(logger: str, **kwargs):
    """`logger` (a class path) built with `kwargs` on rank 0; None on the others."""
    if process_rank() != 0:
        return None
    return get_class(logger)(**kwargs)
