"""The lighthouse where torchft's replica groups meet, in a process of its own: replica group 0's train.py starts it in
a session of its own, so it outlives group 0's training processes (killed as a tree, stopped, or ended first) and
losing group 0 costs the others what losing any group does. It ends once no group has beaten for IDLE_S. Group 0
started again finds it on its port and uses it. What it cannot outlive is its host: where no group's host stays up,
run one on a host that does (`torchft_lighthouse --min_replicas 1 --bind [::]:29510`) and name it to every group."""

import os
import re
import subprocess
import sys
import time
import urllib.request

IDLE_S = 60.0  # a lighthouse no group has beaten for this long (after the first) ends
FIRST_S = 600.0  # how long it waits for a first group


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

    server = LighthouseServer(bind=f"[::]:{port}", min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                              heartbeat_timeout_ms=heartbeat_timeout_ms)  # fmt: skip
    address, allowed, last = f"http://localhost:{port}", FIRST_S, time.monotonic()
    while time.monotonic() - last < allowed:
        time.sleep(1)
        if beating(status(address) or ""):
            allowed, last = IDLE_S, time.monotonic()
    server.shutdown()


if __name__ == "__main__":
    from pathlib import Path

    Path("/proc/self/comm").write_text("lighthouse")  # ps shows what it is
    serve(*map(int, sys.argv[1:5]))
