"""The run's failure, recorded once in its store: the first process to meet one writes `failed` (its exit code, its
node and its line) and says the line; every other process, launcher and node reads it there and leaves with its
code, saying nothing more (another node's launcher says it too). The record carries the job token's proof
(job_token.py): one a stranger wrote is no failure, and a process that fails replaces it."""

import contextlib

from starter.errors import to_stderr
from starter.job_token import opened, read_signed, signed
from starter.run_store import answers
from starter.topology import key_prefix


def report(store, code: int, line: str, node: int = 0, prefix: str | None = None, say: bool = True) -> bool:
    """Write `failed` unless a process did first; write `failed/said` and print `line` only then (if `say`); a process
    killed before the mark has not: its launcher says it. Returns whether this was the first. `node`: the node
    whose process met it (another node's launcher says it too)."""
    key = f"{prefix or key_prefix()}/failed"
    mine = signed(key, f"{code}|{node}|{line}")
    try:
        first = not answers(store) or (found := store.compare_set(key, "", mine)).decode() == mine
        if not first and opened(key, found) is None:  # a stranger's: ours replaces it
            store.set(key, mine)
            first = True
    except Exception:  # the store is gone: say it here rather than nowhere
        first = True
    if first and answers(store):  # marked before the line: a launcher waiting for the mark says it only where this
        with contextlib.suppress(Exception):  # process died first (a line twice under load, else)
            store.set(f"{key}/said", signed(f"{key}/said", "1"))
    if first and say:
        to_stderr(f"error: {line}")
    return first


def said(store, prefix: str) -> bool:
    """Whether the process that reported the failure has said its line (where the store is gone: its holder did); a
    stranger's mark is none (the launcher would keep the line unsaid)."""
    key = f"{prefix}/failed/said"
    try:
        return read_signed(store, key) == "1"
    except Exception:
        return True


def failure(store, prefix: str | None = None) -> tuple[int, str, int] | None:
    """(code, line, node) that a process reported; None where none did (or a stranger wrote it), or the store is None or
    gone (its holder has ended: the watchdogs say why)."""
    key = f"{prefix or key_prefix()}/failed"
    try:
        record = (read_signed(store, key) if answers(store) else None) or "||"
        code, node, line = record.split("|", 2)
        return int(code), line, int(node)
    except Exception:  # none reported (int("")), or the store went meanwhile
        return None
