"""Where the processes a process starts come from: one fork server per process, never a fork of the process itself (a
fork copies the threads' state at an arbitrary instant: a lock one held stays held in the child). Python's forkserver
imported `preload` once, so workers start as fast as a fork (without it, each loader iterator imports torch: 1.7 s).
A server starts once, with its first caller's preload, and ignores the scheduler's signals (one ended could not report
its children's exits); the agent's workers restore them, loader workers end with their loaders.
"""

import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
from functools import cache

SERVER_IGNORES = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


@cache
def fork_server(preload: tuple[str, ...]):
    """The multiprocessing context whose processes this process's fork server forks; started on the first call. It gets
    sys.path as PYTHONPATH: a server of Python < 3.12.8 is given sys.path and does not apply it (CPython gh-117378), and
    a module found only there fails its preload in silence."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([*preload, "starter.fork_server_exit"])
    handlers = {signum: signal.signal(signum, signal.SIG_IGN) for signum in SERVER_IGNORES}  # inherited by exec
    python_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(entry for entry in sys.path if entry)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        if python_path is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = python_path
    return context
