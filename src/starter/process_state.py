"""What a process of this host is doing, by its pid: ended, stopped, or alive and running (a loaded machine's process
is slow, not lost)."""

import os
from pathlib import Path


def gone(pid: int) -> bool:
    """Whether process `pid` has ended (exited, or a zombie that its parent has not reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return process_state(pid) == "Z"


def process_state(pid: int) -> str | None:
    """The state /proc gives process `pid` (R running, S sleeping, T stopped, Z zombie...); None without one."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def runs(pid: int) -> bool:
    """Whether process `pid` lives and is not stopped (it may be slow: starved on a loaded machine)."""
    return process_state(pid) not in (None, "T", "Z")
