"""Which address of this host its peers on other hosts reach, and gloo's device for it.

Debian's /etc/hosts maps a host's own name to a loopback address, and what gloo and torchft publish by default is that
name: a peer on another host then dials its own loopback and waits forever. What a process publishes is instead the
address of the interface that routes to its peers (asked of the kernel's routing table: a UDP socket connected to
them, which sends nothing), or the one the user named; gloo is given that interface where its own choice, the host's
name, would be loopback."""

import fcntl
import ipaddress
import logging
import os
import socket
import struct

from starter.errors import UserError

log = logging.getLogger(__name__)

SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) is this host's loopback; a name that does not resolve is not."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def route_to(host: str) -> str | None:
    """This host's address on the route to `host` (the kernel's choice); None where there is none."""
    try:
        family, *_, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            return probe.getsockname()[0]
    except OSError:
        return None


def interfaces() -> dict[str, str]:
    """This host's IPv4 addresses by interface name (those that have one)."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
            found[name] = socket.inet_ntoa(answer[20:24])
    return found


def this_host(named: str | None, peer: str | None) -> tuple[str | None, str]:
    """The address of this host that peers on other hosts reach, and what decided it; None where nothing can say.
    `named`: the user's; `peer`: a host the peers are at (a lighthouse, MASTER_ADDR), where one is known."""
    if named:
        return named, "named"
    if peer:
        return route_to(peer), f"the route to {peer}"
    if not is_loopback(socket.gethostname()):
        return socket.gethostname(), "this host's name"
    if chosen := os.environ.get("GLOO_SOCKET_IFNAME"):
        return interfaces().get(chosen.split(",")[0]), f"GLOO_SOCKET_IFNAME={chosen}"
    outside = [address for address in interfaces().values() if not ipaddress.ip_address(address).is_loopback]
    return (outside[0], "this host's only interface") if len(outside) == 1 else (None, "")


def choose_gloo_device(address: str) -> None:
    """Where gloo would bind to loopback (no GLOO_SOCKET_IFNAME, the host's name resolving to loopback) while peers
    on other hosts reach this one at `address`: GLOO_SOCKET_IFNAME set to that address's interface, for this process
    and those it starts; where no interface holds it, one line saying what to set."""
    if os.environ.get("GLOO_SOCKET_IFNAME") or is_loopback(address) or not is_loopback(socket.gethostname()):
        return
    ip = socket.gethostbyname(address)
    name = next((name for name, held in interfaces().items() if held == ip), None)
    if name is None:
        raise UserError(
            f"this host's name ({socket.gethostname()}) resolves to loopback and no interface of it holds {address},"
            " where its peers reach it; set GLOO_SOCKET_IFNAME to the interface they reach (e.g. eth0)"
        )
    os.environ["GLOO_SOCKET_IFNAME"] = name
    log.info("gloo binds to %s (%s): this host's name resolves to loopback", name, ip, extra={"file_only": True})
