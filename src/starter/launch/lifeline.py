"""A connection between rank 0 and each other rank, held by their watchdogs, so that a process that is gone is named in
seconds: its operating system closes its sockets when it ends (SIGKILLed, or its node's agent killed it too), and the
peer's beat, waiting on it, reads the end at once. One that leaves on its own says "bye" first. One alive but silent
(stopped, hung in C) keeps it open: the heartbeat names it. Rank 0 listens where its peers reach it (the run's
address), on a port the OS picks, told them in the store with a secret of the run: a connection that does not send
its rank and that secret within seconds (a port scan, a stranger) is closed and changes nothing."""

import secrets
import select
import socket
import time

HELLO_S = 5.0  # how long a new connection has to say who it is


class Lifeline:
    def __init__(self, store, prefix: str, address: str, rank: int):
        self.rank, self.peers, self.unknown = rank, {}, {}  # rank -> socket; socket -> when it connected
        if rank == 0:
            try:
                self.server = socket.create_server((address, 0))
            except OSError:  # an address this host does not hold (a name routed to it): every interface
                self.server = socket.create_server(("", 0))
            self.server.setblocking(False)
            self.secret = secrets.token_hex(16)
            store.set(f"{prefix}/lifeline", f"{self.server.getsockname()[1]} {self.secret}")
        else:
            port, secret = store.get(f"{prefix}/lifeline").decode().split()  # rank 0's, published
            self.peers[0] = socket.create_connection((address, int(port)), timeout=10)
            self.peers[0].sendall(f"{rank} {secret}\n".encode())

    def gone(self) -> list[int]:
        """The ranks whose connection closed without a "bye" since the last call (rank 0: any; others: rank 0)."""
        while self.rank == 0:  # those that connected say who they are (rank and secret) before they count
            try:
                self.unknown[self.server.accept()[0]] = time.monotonic()
            except BlockingIOError:
                break
        for peer in select.select(list(self.unknown), [], [], 0)[0]:
            said, _ = self._read(peer).split(), self.unknown.pop(peer)
            if len(said) == 2 and said[0].isdigit() and secrets.compare_digest(said[1], self.secret.encode()):
                self.peers[int(said[0])] = peer
            else:
                peer.close()
        for peer in [p for p, since in self.unknown.items() if time.monotonic() - since > HELLO_S]:
            del self.unknown[peer]
            peer.close()
        readable, _, _ = select.select(list(self.peers.values()), [], [], 0)
        closed = []
        for rank, peer in [(rank, peer) for rank, peer in self.peers.items() if peer in readable]:
            data = self._read(peer)
            if not data or b"bye" in data:  # gone, or left on its own: watched no more
                self.peers.pop(rank, None)
                peer.close()
                closed += [] if data else [rank]
        return closed

    @staticmethod
    def _read(peer) -> bytes:
        try:
            return peer.recv(64)
        except OSError:  # reset
            return b""

    def wait(self, seconds: float, *also) -> None:
        """Until a peer says something or closes (or a rank connects, or one of `also` is readable), at most
        `seconds`."""
        watched = [*self.peers.values(), *self.unknown, *([self.server] if self.rank == 0 else []), *also]
        try:
            select.select(watched, [], [], seconds)
        except (OSError, ValueError):  # closed by close(): this process is leaving
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
