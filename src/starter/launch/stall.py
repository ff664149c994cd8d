"""A run whose ranks all answer the heartbeat may still wait forever: one main thread deadlocked, the others waiting
for it in a collective. Each watchdog beat carries how far the main thread has got (callbacks/batch_ticks.py) and,
when that has not moved, where it is; rank 0's `Stall` names whom the run waits for once no rank has moved for
`stall_timeout_s`."""

import os
import sys
import sysconfig
import threading
import time
from collections.abc import Callable

from starter.job_token import opened


def read_progress(store, prefix: str, world: int) -> dict[int, tuple[int, int, str]] | None:
    """{rank: (boundaries, loops, where)} of every rank, or None before every rank has said it once (or where a value
    is not the rank's: a stranger's, without the job token's proof, is no progress)."""
    keys = [f"{prefix}/progress/{rank}" for rank in range(world)]
    if not store.check(keys):
        return None
    found = {}
    for rank, (key, value) in enumerate(zip(keys, store.multi_get(keys))):
        said = (opened(key, value) or "").split("|", 2)
        if len(said) != 3 or not (said[0].isdigit() and said[1].isdigit()):
            return None
        found[rank] = (int(said[0]), int(said[1]), said[2])
    return found


class Stall:
    """Rank 0's judge: a line naming whom the run waits for, once every rank is inside a loop (outside, a process may
    work alone for long) and no rank's count has moved for `timeout_s`."""

    SHOWN = 4  # ranks named in the line at most
    ENDS = "every process of the run stops (raise stall_timeout_s if a step or a checkpoint save takes longer)"

    def __init__(self, timeout_s: float, name: Callable[[int], str]):
        """`name`: what a rank is called in the line (rank 1 (node 0))."""
        self.timeout_s, self.name = timeout_s, name
        self.counts, self.since = None, time.monotonic()

    def check(self, progress: dict[int, tuple[int, int, str]] | None, now: float) -> str | None:
        if progress is None:
            return None
        counts = {rank: boundaries for rank, (boundaries, _, _) in progress.items()}
        if counts != self.counts or not all(loops > 0 for _, loops, _ in progress.values()):
            self.counts, self.since = counts, now
            return None
        if now - self.since <= self.timeout_s:
            return None
        return self.line(progress)

    def line(self, progress: dict[int, tuple[int, int, str]]) -> str:
        least, most = min(self.counts.values()), max(self.counts.values())
        behind = [rank for rank, count in self.counts.items() if count == least] if least < most else []
        named = behind or list(progress)
        shown = ", ".join(f"{self.name(rank)} in {progress[rank][2] or '?'}" for rank in named[: self.SHOWN])
        if len(named) > self.SHOWN:
            shown += f" and {len(named) - self.SHOWN} more"
        seconds = f"{self.timeout_s:.0f} s"
        if behind:
            who = (
                f"{shown} {'has' if len(behind) == 1 else 'have'} made no progress for {seconds} while the others wait"
            )
        else:
            who = f"no rank has made progress for {seconds} (a deadlock: {shown})"
        return f"{who}; {self.ENDS}"


def main_thread_at() -> str:
    """Where the main thread is: its innermost frame outside Python's own library, as 'function (file:line)'."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    paths = sysconfig.get_paths()
    packages = (paths["purelib"], paths["platlib"])
    while frame is not None:
        file = frame.f_code.co_filename
        if not (file.startswith("<") or file.startswith(paths["stdlib"]) and not file.startswith(packages)):
            return f"{frame.f_code.co_name} ({_short(file)}:{frame.f_lineno})"
        frame = frame.f_back
    return ""


def _short(file: str) -> str:
    for marker in ("site-packages/", "dist-packages/"):
        if marker in file:
            return file.split(marker, 1)[1]
    return os.path.relpath(file) if file.startswith(os.getcwd() + os.sep) else file
