"""The lighthouse where torchft's replica groups meet, in a process of its own: replica group 0's train.py starts it in
a session of its own, so it outlives group 0's training processes (killed as a tree, stopped, or ended first) and
losing group 0 costs the others what losing any group does. It ends once no group has beaten for IDLE_S. Group 0
started again finds it on its port and uses it. What it cannot outlive is its host: where no group's host stays up,
run one on a host that does (`python -m starter.strategies.lighthouse 29510 1 60000 5000`: port, min_replicas, join and
heartbeat timeouts in ms) and name it to every group. Its port passes torchft's gRPC and serves the status page, and
refuses every other request: torchft's own lighthouse would pass anyone's kill request to a group."""

import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request

IDLE_S = 60.0  # a lighthouse no group has beaten for this long (after the first) ends
FIRST_S = 600.0  # how long it waits for a first group
HTTP2 = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"  # how torchft's gRPC connections begin


def start(port: int, min_replicas: int, join_timeout_s: float, heartbeat_timeout_s: float) -> tuple[str, bool]:
    """The address of the lighthouse at `port` on this host, and whether it was started now: else the one serving
    there (group 0 started again). Raises OSError where it does not come up (the port taken by something else)."""
    address = f"http://localhost:{port}"
    if started := not serving(address):
        command = [sys.executable, "-m", "starter.strategies.lighthouse", str(port), str(min_replicas),
                   str(int(join_timeout_s * 1000)), str(int(heartbeat_timeout_s * 1000))]  # fmt: skip
        env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "warn"))
        proc = subprocess.Popen(command, env=env, start_new_session=True, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
        deadline = time.monotonic() + 60
        while not serving(address):
            if proc.poll() is not None or time.monotonic() > deadline:
                said = proc.stderr.read().decode(errors="replace").strip().splitlines() if proc.poll() else []
                raise OSError(said[-1] if said else "it did not come up within 60 s")
            time.sleep(0.1)
        proc.stderr.close()
    return address, started


def serving(address: str) -> bool:
    """Whether a lighthouse answers at `address`; raises OSError where something else does."""
    if (page := status(address)) is not None and not is_lighthouse(page):
        raise OSError(f"something that is not a torchft lighthouse answers at {address}")
    return page is not None


def is_lighthouse(page: str) -> bool:
    """Whether a status page is torchft's lighthouse's (its quorum's id and status lines)."""
    return "Current quorum_id:" in page and "Next quorum status:" in page


def status(address: str) -> str | None:
    """The lighthouse's status page; None where none answers."""
    try:
        with urllib.request.urlopen(f"{address}/status", timeout=2) as page:
            return page.read().decode(errors="replace")
    except (OSError, ValueError):  # ValueError: not an http:// address
        return None


def beating(page: str) -> int:
    """How many groups the status page shows beating within the heartbeat timeout (torchft marks the others old)."""
    return sum(not old for old in re.findall(r'class="heartbeat\s*(old)?\s*"', page))


def serve(port: int, min_replicas: int, join_timeout_ms: int, heartbeat_timeout_ms: int) -> None:
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                              heartbeat_timeout_ms=heartbeat_timeout_ms)  # fmt: skip
    inner = int(server.address().rsplit(":", 1)[1])
    front = socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=True)
    threading.Thread(target=_front, args=(front, inner), daemon=True).start()
    address, allowed, last = f"http://localhost:{port}", FIRST_S, time.monotonic()
    while time.monotonic() - last < allowed:
        time.sleep(1)
        if beating(status(address) or ""):
            allowed, last = IDLE_S, time.monotonic()
    server.shutdown()


def _front(front: socket.socket, inner: int) -> None:
    """The lighthouse's port: torchft's gRPC (HTTP/2) passed to the lighthouse, its status page (GET) served; any other
    request refused, its kill request (POST /replica/<id>/kill, which ends a group's process at once) among them."""
    while True:
        conn, _ = front.accept()
        threading.Thread(target=_answer, args=(conn, inner), daemon=True).start()


def _answer(conn: socket.socket, inner: int) -> None:
    with contextlib.suppress(OSError):
        conn.settimeout(10)
        head = conn.recv(len(HTTP2), socket.MSG_PEEK)
        while head and len(head) < len(HTTP2) and HTTP2.startswith(head):  # the preface in parts
            time.sleep(0.01)
            head = conn.recv(len(HTTP2), socket.MSG_PEEK)
        if head == HTTP2:
            conn.settimeout(None)
            lighthouse = socket.create_connection(("127.0.0.1", inner))
            threading.Thread(target=_pipe, args=(lighthouse, conn), daemon=True).start()
            _pipe(conn, lighthouse)
            return
        request = b""
        while b"\r\n\r\n" not in request and len(request) < 8192 and (data := conn.recv(4096)):
            request += data
        method, path = (request.split(b"\r\n", 1)[0].split() + [b"", b""])[:2]
        if method == b"GET" and path in (b"/", b"/status"):
            with urllib.request.urlopen(f"http://127.0.0.1:{inner}{path.decode()}", timeout=10) as page:
                _reply(conn, "200 OK", page.read())
        else:
            _reply(conn, "403 Forbidden", b"refused: this lighthouse answers GET /status only\n")
    conn.close()


def _reply(conn: socket.socket, status: str, body: bytes) -> None:
    head = f"HTTP/1.1 {status}\r\nContent-Type: text/html\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    conn.sendall(head.encode() + body)


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            sink.sendall(data)
    for end in (source, sink):
        with contextlib.suppress(OSError):
            end.shutdown(socket.SHUT_RDWR)
            end.close()


if __name__ == "__main__":
    from pathlib import Path

    Path("/proc/self/comm").write_text("lighthouse")  # ps shows what it is
    serve(*map(int, sys.argv[1:5]))
