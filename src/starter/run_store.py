"""The run's store (torch's TCPStore), where the processes of a several-process run meet: served where its peers reach
it and nowhere else, reached with a probe first, and never called once its server has gone (a call to a store whose
holder has ended retries, and torch prints a C++ trace for each try)."""

import errno
import ipaddress
import socket
from datetime import timedelta


def listener(address: str, port: int = 0) -> socket.socket:
    """A socket listening at `port` (0: one the OS picks) on `address`, where the run's peers reach it, not on every
    interface. A name this host does not hold (one routed to it), or maps to a loopback address while the peers are
    told it (Debian's 127.0.1.1 for its own name): every interface."""
    try:
        ip = socket.gethostbyname(address)
        if ipaddress.ip_address(ip).is_loopback and address not in (ip, "localhost"):
            raise OSError(errno.EADDRNOTAVAIL, "a name mapped to loopback")
        return socket.create_server((ip, port))
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise
        dual = socket.has_dualstack_ipv6()
        return socket.create_server(("", port), family=socket.AF_INET6 if dual else socket.AF_INET, dualstack_ipv6=dual)


def serve_store(address: str, port: int = 0, **options):
    """A store at `port` (0: one the OS picks) on `address` (listener), held for as long as the returned object
    lives."""
    from torch.distributed import TCPStore

    bound = listener(address, port)
    port = bound.getsockname()[1]
    return TCPStore(address, port, is_master=True, wait_for_workers=False, master_listen_fd=bound.detach(), **options)


def client(address: str, port: int, timeout_s: float):
    """A client of the store at address:port; raises at once where nothing listens (a client would retry)."""
    from torch.distributed import TCPStore

    if not listening(address, port):
        raise ConnectionError(f"no store answers at {address}:{port}")
    return TCPStore(address, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


def reach(address: str, port: int, timeout_s: float):
    """client(), or None where no store answers there."""
    try:
        return client(address, port, timeout_s)
    except Exception:  # nothing listens, or it went as it was reached (torch's DistNetworkError)
        return None


def answers(store) -> bool:
    """Whether the server of `store` (a client's, or one served here) accepts connections."""
    return store is not None and listening(store.host, store.port)


def listening(address: str, port: int) -> bool:
    """Whether a server accepts connections at address:port. (A socket connected to itself, which a local port of
    the ephemeral range with no listener can give, is not one.)"""
    try:
        with socket.create_connection((address, port), timeout=2) as probe:
            return probe.getsockname() != probe.getpeername()
    except OSError:
        return False


def free_port(address: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]
