"""Ending a process without the interpreter's teardown.

A process that imported Lightning (3,700 modules) spends 1.5-2.5 s after its last line freeing them one by one and
running native destructors, and its launcher, its parent's join, a shell pipe all wait for that. Nothing of ours needs
it: by then every file is written and closed, and what the interpreter does first is done here: wait for the threads
that are not daemons, run the exit hooks (logging's, a logger's, multiprocessing's). Python's forkserver ends each
process it forks the same way (os._exit after multiprocessing's exit hooks).
"""

import atexit
import os
import sys
import threading
from contextlib import contextmanager


@contextmanager
def quick_exit():
    """Runs the block; its end (return or SystemExit) ends the process at once, with the exit code SystemExit gives.
    Any other exception goes on as usual: its traceback, then the interpreter's teardown."""
    try:
        yield
        code = 0
    except SystemExit as stop:
        code = stop.code
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)  # as the interpreter does for SystemExit("message")
        code = 1
    threading._shutdown()  # as the interpreter ends: wait for the threads that are not daemons (a writer's queue)
    atexit._run_exitfuncs()  # then the exit hooks, before its teardown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
