"""Where the processes a process starts come from: one fork server per process, never a fork of the process itself.

Python's forkserver is a fresh, single-threaded interpreter that imported `preload` once and forks each new process
from itself. A fork of the asking process would copy its threads' state at an arbitrary instant (gloo's, the store's,
the watchdog's, an allocator's background thread: pyarrow's jemalloc runs one wherever pandas is imported), and a lock
one of them held would be held in the child forever. Our launcher starts its workers here, and every training process
its data loaders' workers. Preloaded, a server forks as fast as fork does (a loader's 2 workers ready in 0.05 s);
without, each new process imports torch itself (1.7 s per loader iterator; about 5 s where the dataset's module
imports Lightning: the stall that kept loaders on fork before).

A process's server starts once, with the preload of its first caller. It ignores the scheduler's signals: a scheduler
signals every process of a job, and a server they ended could no longer report its children's exits. What it starts
inherits that: our launcher's workers restore the defaults and act on them; loader workers keep ignoring them and end
when their training process shuts its loaders down (or, with it gone, when their server goes).
"""

import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
from contextlib import contextmanager
from functools import cache

SERVER_IGNORES = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


@cache
def fork_server(preload: tuple[str, ...]):
    """The multiprocessing context whose processes this process's fork server forks; started on the first call."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([*preload, "starter.launch.fork_server_exit"])
    handlers = {signum: signal.signal(signum, signal.SIG_IGN) for signum in SERVER_IGNORES}  # inherited by exec
    try:
        with _python_path(sys.path):
            multiprocessing.forkserver.ensure_running()
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    return context


@contextmanager
def _python_path(path: list[str]):
    """PYTHONPATH for a process started inside the block. A server of Python 3.10 or 3.11 (3.12 before 3.12.8) is
    given this process's sys.path and does not apply it (CPython gh-117378, whose fix names this workaround): a module
    found only there (a data set in tests/, or beside a script run from elsewhere) fails its preload in silence, and
    then every worker imports it, and all it imports, itself (3 s per loader iterator where that was Lightning)."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(entry for entry in path if entry)
    try:
        yield
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
