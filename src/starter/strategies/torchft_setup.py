"""fault_tolerance=torchft: what torchft is set up with. Its import (its chatter off the console), the lighthouse
replica group 0 starts, the quorum's process group (saying which groups each quorum lost or gained, and comparing
their configs before any collective), and the heal's transport (read weights-only)."""

import logging
import os
from datetime import timedelta

from starter.errors import UserError, one_line
from starter.loggers.console import file_only
from starter.strategies.replica_agreement import disagreement
from starter.topology import TORCHFT_MISSING

log = logging.getLogger("starter.strategies.fault_tolerant")  # the lines are the replica groups' own

LOGGERS = ("torchft.manager", "torchft.process_group", "torchft.checkpointing.http_transport", "torchft_errors")


def torchft():
    """torchft, imported; its servers' chatter off the console (Rust's, on stderr: warnings only) and its handled
    errors in the run's log only (the line saying what they did to the step is ours)."""
    os.environ.setdefault("RUST_LOG", "warn")
    for name in LOGGERS:
        logging.getLogger(name).addFilter(file_only)
    try:
        import torchft
    except ImportError:
        raise UserError(TORCHFT_MISSING) from None
    return torchft


def start_lighthouse(ft) -> None:
    """Replica group 0 starts the lighthouse (strategies/lighthouse.py: a process of its own, which outlives it) when no
    address is given (`fault_tolerance.lighthouse`, else TORCHFT_LIGHTHOUSE); the other groups must be told where it
    is."""
    if address := ft.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE"):
        os.environ["TORCHFT_LIGHTHOUSE"] = address
        return
    torchft()
    from starter.strategies import lighthouse

    try:
        address = lighthouse.start(ft.lighthouse_port, ft.min_replicas, ft.join_timeout_s, ft.heartbeat_timeout_s)
    except OSError as err:  # the port taken by something else
        raise UserError(
            f"replica group 0 cannot serve the lighthouse at port {ft.lighthouse_port} ({one_line(err)[:120]}); give"
            " another fault_tolerance.lighthouse_port, the same to every group"
        ) from None
    os.environ["TORCHFT_LIGHTHOUSE"] = address
    log.info("replica group 0 started the lighthouse at %s (a process of its own: it outlives this group)", address)


def saying_quorums(process_group_class, strategy, **kwargs):
    """torchft's process group, saying in one line which replica groups each new quorum lost or gained."""

    class Quorum(process_group_class):
        def configure(self, store_addr: str, *args, **kwargs):  # the manager passes the quorum's ranks eighth
            global_ranks = args[6] if len(args) > 6 else kwargs.get("global_ranks")
            groups = sorted({rank // strategy.world_size for rank in global_ranks or ()})
            strategy.disagreement = disagreement(store_addr, strategy, global_ranks, joining=strategy.joining)
            if strategy.disagreement and not strategy.joining and strategy.global_rank == 0:
                log.warning(strategy.disagreement)
            super().configure(store_addr, *args, **kwargs)
            lost, came = sorted(set(strategy.groups) - set(groups)), sorted(set(groups) - set(strategy.groups))
            if strategy.groups and (lost or came) and strategy.global_rank == 0:
                what = "; ".join(
                    f"replica group{'s' * (len(g) > 1)} {', '.join(map(str, g))} {verb}"
                    for g, verb in ((lost, "lost"), (came, "joined"))
                    if g
                )
                log.warning("%s: training on with %d of %d", what, len(groups), strategy.ft.replica_groups)
            strategy.groups = groups

    return Quorum(**kwargs)


def weights_only_transport(**kwargs):
    """torchft's HTTP checkpoint transport, its checkpoints read weights-only (torchft's own reads unpickle)."""
    from torchft.checkpointing._serialization import _streaming_load
    from torchft.checkpointing.http_transport import HTTPTransport

    class WeightsOnlyHTTP(HTTPTransport):
        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            import urllib.request

            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
                return _streaming_load(f, weights_only=True)

    transport = WeightsOnlyHTTP(**kwargs)
    transport._server.RequestHandlerClass.log_message = lambda *args: None  # a line per heal on the console
    return transport
