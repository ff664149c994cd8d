"""A logger built on rank 0 only: MLFlowLogger opens its store in its constructor, and two ranks creating one SQLite
store at once can kill one in its schema migration. The other ranks get None (left out by run.py)."""

from hydra.utils import get_class

from starter.topology import process_rank


def on_rank_zero(logger: str, **kwargs):
    """`logger` (a class path) built with `kwargs` on rank 0; None on the others."""
    return get_class(logger)(**kwargs) if process_rank() == 0 else None
