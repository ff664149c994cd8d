"""A connection between rank 0 and each other rank, held by their watchdogs, so that a process that is gone is named in
seconds: when a process ends, its operating system closes its sockets (also where it was SIGKILLed or its node's
agent killed it), and the peer reads the end at its next beat. A process that leaves on its own says "bye" first.
A process that is alive but silent (stopped, hung in C) keeps its connection open: the heartbeat names it after
`heartbeat_timeout_s`. Rank 0 listens on a port the OS picks, published in the run's store (`lifeline`)."""

import select
import socket


class Lifeline:
    def __init__(self, store, prefix: str, address: str, rank: int):
        self.rank, self.peers, self.left = rank, {}, set()  # peers: rank -> socket
        if rank == 0:
            self.server = socket.create_server(("", 0))
            self.server.setblocking(False)
            store.set(f"{prefix}/lifeline", str(self.server.getsockname()[1]))
        else:
            port = int(store.get(f"{prefix}/lifeline").decode())  # published: see ready()
            self.peers[0] = socket.create_connection((address, port), timeout=10)
            self.peers[0].sendall(f"{rank}\n".encode())

    @staticmethod
    def ready(store, prefix: str, rank: int) -> bool:
        """Whether this rank can hold its lifeline now: rank 0 at once, the others once rank 0 published its port."""
        return rank == 0 or store.check([f"{prefix}/lifeline"])

    def gone(self) -> list[int]:
        """The ranks whose connection closed without a "bye", since the last call (rank 0: any; others: rank 0)."""
        if self.rank == 0:
            self._accept()
        readable, _, _ = select.select(list(self.peers.values()), [], [], 0)
        closed = []
        for rank, peer in list(self.peers.items()):
            if peer in readable:
                try:
                    data = peer.recv(64)
                except OSError:  # reset
                    data = b""
                if b"bye" in data or not data:
                    del self.peers[rank]
                    peer.close()
                if not data and rank not in self.left:
                    closed.append(rank)
                elif b"bye" in data:
                    self.left.add(rank)
        return closed

    def _accept(self) -> None:
        while True:
            try:
                peer, _ = self.server.accept()
            except BlockingIOError:
                return
            peer.setblocking(True)
            peer.settimeout(10)
            said = peer.recv(16)  # its rank, sent at once by the rank that connected (and "bye" if it left since)
            rank = int(said.split()[0])
            if b"bye" in said:
                self.left.add(rank)
                peer.close()
            else:
                self.peers[rank] = peer

    def close(self) -> None:
        """This process leaves on its own: its peers are told, then its connections closed."""
        for peer in self.peers.values():
            try:
                peer.sendall(b"bye\n")
                peer.close()
            except OSError:
                pass
        self.peers = {}
        if self.rank == 0:
            self.server.close()
