"""A connection between rank 0 and each other rank, held by their watchdogs, so that a process that is gone is named in
seconds: its operating system closes its sockets when it ends (SIGKILLed, or its node's agent killed it too), and the
peer's beat, waiting on it, reads the end at once. One that leaves on its own says "bye" first. One alive but silent
(stopped, hung in C) keeps it open: the heartbeat names it. Rank 0 listens on a port the OS picks, in the store."""

import select
import socket


class Lifeline:
    def __init__(self, store, prefix: str, address: str, rank: int):
        self.rank, self.peers = rank, {}  # rank -> socket
        if rank == 0:
            self.server = socket.create_server(("", 0))
            self.server.setblocking(False)
            store.set(f"{prefix}/lifeline", str(self.server.getsockname()[1]))
        else:
            port = int(store.get(f"{prefix}/lifeline").decode())  # rank 0's, published
            self.peers[0] = socket.create_connection((address, port), timeout=10)
            self.peers[0].sendall(f"{rank}\n".encode())

    def gone(self) -> list[int]:
        """The ranks whose connection closed without a "bye" since the last call (rank 0: any; others: rank 0)."""
        while self.rank == 0:  # accept those that connected: each sends its rank at once
            try:
                peer, _ = self.server.accept()
            except BlockingIOError:
                break
            peer.settimeout(10)
            self.peers[int(peer.recv(16).split()[0])] = peer
        readable, _, _ = select.select(list(self.peers.values()), [], [], 0)
        closed = []
        for rank, peer in [(rank, peer) for rank, peer in self.peers.items() if peer in readable]:
            try:
                data = peer.recv(64)
            except OSError:  # reset
                data = b""
            if not data or b"bye" in data:  # gone, or left on its own: watched no more
                self.peers.pop(rank, None)
                peer.close()
                closed += [] if data else [rank]
        return closed

    def wait(self, seconds: float) -> None:
        """Until a peer says something or closes (or a rank connects), at most `seconds`."""
        watched = [*self.peers.values(), *([self.server] if self.rank == 0 else [])]
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
