"""A connection between rank 0 and each other rank, held by their watchdogs, so that a process that is gone is named in
seconds: its operating system closes its sockets when it ends (SIGKILLed, or its node's agent killed it too), and the
peer's beat, waiting on it, reads the end at once. One that leaves on its own says "bye" first. One alive but silent
(stopped, hung in C) keeps it open: the heartbeat names it.

Rank 0 listens where its peers reach it (the run's address), on a port the OS picks, published in the run's store. Each
rank proves who it is with a token of its own that only its connection carries: the store holds the token's hash,
never the token, so nothing read from the store lets a stranger speak for a rank. A connection that does not prove a
rank not yet connected within seconds (a port scan, a stranger, a replay) is closed and changes nothing; at most
`PENDING` wait to prove it at once (a flood of connections closes the oldest, never runs out of descriptors)."""

import errno
import hashlib
import ipaddress
import secrets
import selectors
import socket
import time

HELLO_S = 5.0  # how long a new connection has to say who it is
PENDING = 64  # connections yet to say who they are, at most


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


def proof(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Lifeline:
    def __init__(self, store, prefix: str, address: str, rank: int):
        self.store, self.prefix, self.rank = store, prefix, rank
        self.peers, self.unknown = {}, {}  # rank -> socket; socket -> when it connected
        self.selector = selectors.DefaultSelector()  # poll, not select(): any descriptor number, any count
        if rank == 0:
            self.server = listener(address)
            self.server.setblocking(False)
            self.selector.register(self.server, selectors.EVENT_READ)
            store.set(f"{prefix}/lifeline", str(self.server.getsockname()[1]))
        else:
            token = secrets.token_hex(16)
            store.set(f"{prefix}/lifeline/proof/{rank}", proof(token))
            port = int(store.get(f"{prefix}/lifeline").decode())  # rank 0's, published
            self._watch(0, socket.create_connection((address, port), timeout=10))
            self.peers[0].sendall(f"{rank} {token}\n".encode())

    def gone(self) -> list[int]:
        """The ranks whose connection closed without a "bye" since the last call (rank 0: any; others: rank 0)."""
        while self.rank == 0:  # those that connected prove who they are before they count
            try:
                peer, _ = self.server.accept()
            except (BlockingIOError, OSError):
                break
            if len(self.unknown) >= PENDING:  # the oldest makes room: a rank says who it is as it connects
                oldest = min(self.unknown, key=self.unknown.get)
                del self.unknown[oldest]
                self._drop(oldest)
            self.unknown[peer] = time.monotonic()
            self.selector.register(peer, selectors.EVENT_READ)
        ready = self._ready()
        for peer in [p for p in self.unknown if p in ready]:
            del self.unknown[peer]
            if (rank := self._proven(self._read(peer))) is not None:
                self.peers[rank] = peer
            else:
                self._drop(peer)
        for peer in [p for p, since in self.unknown.items() if time.monotonic() - since > HELLO_S]:
            del self.unknown[peer]
            self._drop(peer)
        closed, ready = [], self._ready()  # again: a hello read above is not a peer's word
        for rank, peer in [(rank, peer) for rank, peer in self.peers.items() if peer in ready]:
            data = self._read(peer)
            if not data or b"bye" in data:  # gone, or left on its own: watched no more
                self.peers.pop(rank, None)
                self._drop(peer)
                closed += [] if data else [rank]
        return closed

    def _proven(self, said: bytes) -> int | None:
        """The rank a connection proved it is ("rank token"), where no connection holds it yet; else None."""
        words = said.split()
        if len(words) != 2 or not words[0].isdigit() or int(words[0]) in (0, *self.peers):
            return None
        key = f"{self.prefix}/lifeline/proof/{int(words[0])}"
        try:
            expected = self.store.get(key) if self.store.check([key]) else b""
        except (OSError, RuntimeError):
            return None
        token = words[1].decode(errors="replace")
        return int(words[0]) if expected and secrets.compare_digest(proof(token).encode(), expected) else None

    def _ready(self) -> set:
        """The connections a read from would not wait on (data, or their end)."""
        try:
            return {key.fileobj for key, _ in self.selector.select(0)}
        except (OSError, ValueError):
            return set()

    def _watch(self, rank: int, peer) -> None:
        self.peers[rank] = peer
        self.selector.register(peer, selectors.EVENT_READ)

    def _drop(self, peer) -> None:
        try:
            self.selector.unregister(peer)
        except (KeyError, ValueError):
            pass
        peer.close()

    @staticmethod
    def _read(peer) -> bytes:
        try:
            return peer.recv(64)
        except OSError:  # reset
            return b""

    def wait(self, seconds: float, *also) -> None:
        """Until a peer says something or closes (or a rank connects, or one of `also` is readable), at most
        `seconds`."""
        try:
            for extra in also:
                if extra not in (key.fileobj for key in self.selector.get_map().values()):
                    self.selector.register(extra, selectors.EVENT_READ)
            self.selector.select(seconds)
        except (OSError, ValueError, KeyError, RuntimeError):  # closed by close(): this process is leaving
            pass

    def close(self) -> None:
        """This process leaves on its own: its peers are told, then its connections closed (the main thread's call,
        while the beat thread may read them: it works on a copy)."""
        peers, self.peers = list(self.peers.values()), {}
        for peer in peers:
            try:
                peer.sendall(b"bye\n")
                peer.close()
            except OSError:
                pass
        if self.rank == 0:
            self.server.close()
