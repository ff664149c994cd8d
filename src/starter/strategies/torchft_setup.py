"""fault_tolerance=torchft: what torchft is set up with. Its import (its chatter off the console), the lighthouse
replica group 0 starts, the quorum's process group (saying which groups each quorum lost or gained, and comparing
their configs before any collective), and the heal's transport (read weights-only)."""

import logging
import os
from datetime import timedelta
from urllib.parse import urlsplit

from starter.errors import UserError, one_line
from starter.host_address import choose_gloo_device, is_loopback, this_host
from starter.job_token import proof, proven
from starter.launch.environment import started_externally
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
    is. A named one that answers is checked to be a lighthouse (one that does not answer is torchft's one line)."""
    from starter.strategies import lighthouse

    if address := ft.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE"):
        os.environ["TORCHFT_LIGHTHOUSE"] = address
        try:
            lighthouse.serving(address)
        except OSError:
            raise UserError(
                f"{address} answers, but is not a torchft lighthouse; name the lighthouse's address"
            ) from None
        return
    torchft()
    try:
        address, started = lighthouse.start(
            ft.lighthouse_port, ft.min_replicas, ft.join_timeout_s, ft.heartbeat_timeout_s
        )
    except OSError as err:  # the port taken by something else
        raise UserError(
            f"replica group 0 cannot serve the lighthouse at port {ft.lighthouse_port} ({one_line(err)[:120]}); give"
            " another fault_tolerance.lighthouse_port, the same to every group"
        ) from None
    os.environ["TORCHFT_LIGHTHOUSE"] = address
    how = "started" if started else "found"
    log.info("replica group 0 %s the lighthouse at %s (a process of its own: it outlives this group)", how, address)


def publish_where_reached(ft) -> None:
    """The address this group's processes publish to the others (its store, its manager, the heal's transport):
    where the groups on other hosts reach it (host_address.this_host: the route to a named lighthouse, else this
    host's own), never loopback where a lighthouse elsewhere is named. MASTER_ADDR, the group's store, becomes it where
    it was loopback, and gloo is given its interface. Call before the lighthouse starts; the processes this one
    starts inherit it (STARTER_REPLICA_HOST)."""
    named = ft.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
    peer = urlsplit(named).hostname if named else None
    given = os.environ.get("MASTER_ADDR")
    address, why = this_host(ft.get("host"), peer or (given if given and not is_loopback(given) else None))
    if address is None:
        address = "127.0.0.1"
        if ft.replica_groups > 1:
            log.warning(
                "replica group %d is reached at 127.0.0.1 only (this host's name resolves to loopback and it has"
                " several interfaces or none): groups on other hosts cannot join it; set fault_tolerance.host to the"
                " address they reach it at",
                ft.replica_group,
            )
    elif not is_loopback(address):
        if (not given or is_loopback(given)) and not started_externally():  # torchrun's, srun's: theirs to keep
            os.environ["MASTER_ADDR"] = address
        choose_gloo_device(address)
    os.environ["STARTER_REPLICA_HOST"] = address
    log.info("replica group %d is reached at %s (%s)", ft.replica_group, address, why, extra={"file_only": True})


def reached_at() -> str:
    """This process's address for the others (publish_where_reached), as a URL's host."""
    host = os.environ.get("STARTER_REPLICA_HOST") or "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def store_reached_at() -> str:
    """Where the other groups reach this group's store: MASTER_ADDR, or this host's address where that is loopback
    (torchrun's agent serves it on every interface)."""
    given = os.environ["MASTER_ADDR"]
    return os.environ.get("STARTER_REPLICA_HOST", given) if is_loopback(given) else given


def saying_quorums(process_group_class, strategy, **kwargs):
    """torchft's process group, saying in one line which replica groups each new quorum lost or gained, and refusing a
    quorum with a member that is not this job's or disagrees (replica_agreement.py) before any collective of it:
    torchft then heals from none of it and commits none of its steps."""

    class Quorum(process_group_class):
        def configure(self, store_addr: str, *args, **kwargs):  # the manager passes the quorum's ranks eighth
            global_ranks = args[6] if len(args) > 6 else kwargs.get("global_ranks")
            groups = sorted({rank // strategy.world_size for rank in global_ranks or ()})
            found = disagreement(store_addr, strategy, global_ranks, joining=strategy.joining)
            strategy.disagreement = found
            if found:
                leaves, line = found
                if not leaves:
                    strategy.refuse(line)
                raise RuntimeError(line)  # torchft's: reported, the quorum's step not committed
            strategy.refusing = None
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


def proven_transport(**kwargs):
    """torchft's HTTP checkpoint transport, at the address the others reach (torchft's: the host's name, which may
    resolve to loopback), its heal's state served with the job token's proof of its step and bytes and accepted only
    with it (job_token.py), read weights-only (torchft's own reads unpickle)."""
    import io
    import urllib.request
    from http.server import BaseHTTPRequestHandler

    from torch.utils._pytree import tree_flatten, tree_unflatten
    from torchft.checkpointing._serialization import _streaming_load, _streaming_save
    from torchft.checkpointing.http_transport import HTTPTransport, _to_cpu

    class ProvenHTTP(HTTPTransport):
        served = (-1, b"", "")  # the step, the state's bytes, their proof

        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            step = address.rstrip("/").split("/")[-2]
            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
                body, said = f.read(), f.headers.get("X-Starter-Proof", "")
            if not proven(f"heal|{step}", body, said):
                raise RuntimeError(f"the state to heal from at {address} comes without this job's proof: refused")
            return _streaming_load(io.BytesIO(body), weights_only=True)

        def send_checkpoint(self, dst_ranks, step: int, state_dict, timeout) -> None:
            values, spec = tree_flatten(state_dict)
            buffer = io.BytesIO()
            _streaming_save(tree_unflatten(_to_cpu(values, pin_memory=False), spec), buffer)
            body = buffer.getvalue()
            self.served = (step, body, proof(f"heal|{step}", body))
            self.allow_checkpoint(step)

        def address(self) -> str:
            return f"http://{reached_at()}:{self._server.socket.getsockname()[1]}/checkpoint/"

    transport = ProvenHTTP(**kwargs)

    class Serving(BaseHTTPRequestHandler):
        timeout = transport._timeout.total_seconds()

        def do_GET(self) -> None:
            with transport._checkpoint_lock.r_lock():  # held back until a state is staged
                step, body, said = transport.served
                if self.path != f"/checkpoint/{step}/full":
                    self.send_error(400, f"serving /checkpoint/{step}/full")
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("X-Starter-Proof", said)
                self.end_headers()
                self.wfile.write(body)

        def log_message(self, *args) -> None:  # a line per heal on the console
            pass

    transport._server.RequestHandlerClass = Serving
    return transport
