"""A connection between rank 0 and each other rank, held by their watchdogs, so that a process that is gone is named in
seconds: its operating system closes its sockets when it ends (SIGKILLed, or its node's agent killed it too), and the
peer's beat, waiting on it, reads the end at once. One that leaves on its own says "bye" first. One alive but silent
(stopped, hung in C) keeps it open: the heartbeat names it.
Rank 0 listens where its peers reach it, on a port published in the run's store. Each rank proves who it is with a
token only its connection carries (the store holds its hash, and the port, with the job token's proof: job_token.py):
a connection that proves no rank not yet connected
within seconds (a port scan, a stranger, a replay of what the store holds) is closed and changes nothing; at most
`PENDING` wait at once (a flood closes the oldest silent one, never a rank that said who it is, nor descriptors)."""

import contextlib
import hashlib
import secrets
import selectors
import socket
import time

from starter.job_token import read_signed, signed
from starter.run_store import listener

HELLO_S = 5.0  # how long a new connection has to say who it is
PENDING = 64  # connections yet to say who they are, at most


def proof(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def published_port(store, prefix: str) -> int | None:
    """Rank 0's lifeline port, where rank 0 published it (with the job token's proof)."""
    key = f"{prefix}/lifeline"
    port = read_signed(store, key)
    return int(port) if port and port.isdigit() else None


class Lifeline:
    def __init__(self, store, prefix: str, address: str, rank: int, wakeup: socket.socket | None = None):
        self.store, self.prefix, self.rank = store, prefix, rank
        self.peers, self.unknown = {}, {}  # rank -> socket; socket -> when it connected
        self.selector = selectors.DefaultSelector()  # poll, not select(): any descriptor number, any count
        if wakeup is not None:  # the watchdog's: a signal came
            self.selector.register(wakeup, selectors.EVENT_READ)
        if rank == 0:
            self.server = listener(address)
            self.server.setblocking(False)
            self.selector.register(self.server, selectors.EVENT_READ)
            store.set(f"{prefix}/lifeline", signed(f"{prefix}/lifeline", str(self.server.getsockname()[1])))
        else:
            token, key = secrets.token_hex(16), f"{prefix}/lifeline/proof/{rank}"
            store.set(key, signed(key, proof(token)))
            port = published_port(store, prefix)
            if port is None:
                raise OSError("rank 0's lifeline is not published (or not by the run)")
            self.peers[0] = socket.create_connection((address, port), timeout=10)
            self.selector.register(self.peers[0], selectors.EVENT_READ)
            self.peers[0].sendall(f"{rank} {token}\n".encode())

    def gone(self) -> list[int]:
        """The ranks whose connection closed without a "bye" since the last call (rank 0: any; others: rank 0)."""
        while self.rank == 0:  # those that connected prove who they are before they count
            try:
                peer, _ = self.server.accept()
            except OSError:  # none waits (BlockingIOError)
                break
            if len(self.unknown) >= PENDING and (self._hear_unknown() or len(self.unknown) >= PENDING):
                self._drop(min(self.unknown, key=self.unknown.get))  # ranks heard first: the oldest silent one goes
            self.unknown[peer] = time.monotonic()
            self.selector.register(peer, selectors.EVENT_READ)
        self._hear_unknown()
        closed, ready = [], self._ready()  # again: a hello read above is not a peer's word
        for rank, peer in [(rank, peer) for rank, peer in self.peers.items() if peer in ready]:
            data = self._read(peer)
            if not data or b"bye" in data:  # gone, or left on its own: watched no more
                self.peers.pop(rank, None)
                self._drop(peer)
                closed += [] if data else [rank]
        return closed

    def _hear_unknown(self) -> None:
        """Unproven connections: a rank's proof makes it a peer; anything else, or silence past HELLO_S, closes it."""
        ready = self._ready()
        for peer, since in list(self.unknown.items()):
            if peer in ready and (rank := self._proven(self._read(peer))) is not None:
                del self.unknown[peer]
                self.peers[rank] = peer
            elif peer in ready or time.monotonic() - since > HELLO_S:
                self._drop(peer)

    def _proven(self, said: bytes) -> int | None:
        """The rank a connection proved it is ("rank token"), where no connection holds it yet; else None."""
        words = said.split()
        if len(words) != 2 or not words[0].isdigit() or int(words[0]) in (0, *self.peers):
            return None
        key = f"{self.prefix}/lifeline/proof/{int(words[0])}"
        try:
            expected = read_signed(self.store, key) or ""
        except (OSError, RuntimeError):
            return None
        token = words[1].decode(errors="replace")
        return int(words[0]) if expected and secrets.compare_digest(proof(token), expected) else None

    def _ready(self) -> set:
        """The connections a read from would not wait on (data, or their end)."""
        try:
            return {key.fileobj for key, _ in self.selector.select(0)}
        except (OSError, ValueError):  # closed by close()
            return set()

    def _drop(self, peer) -> None:
        """A connection watched no more (it is forgotten if it had not said who it is)."""
        self.unknown.pop(peer, None)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(peer)
        peer.close()

    @staticmethod
    def _read(peer) -> bytes:
        try:
            return peer.recv(64)
        except OSError:  # reset
            return b""

    def wait(self, seconds: float) -> None:
        """Until a peer says something or closes (or a rank connects, or `wakeup` is readable), at most `seconds`."""
        with contextlib.suppress(OSError, ValueError, KeyError, RuntimeError):  # closed by close(): it is leaving
            self.selector.select(seconds)

    def close(self) -> None:
        """This process leaves on its own: its peers told, its connections closed (from a copy: the beat reads them)."""
        peers, self.peers = list(self.peers.values()), {}
        for peer in peers:
            try:
                peer.sendall(b"bye\n")
                peer.close()
            except OSError:
                pass
        if self.rank == 0:
            self.server.close()
