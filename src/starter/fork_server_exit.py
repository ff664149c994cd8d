"""Imported last by each fork server: when the process it serves is gone, the server ends at once instead of tearing
down its torch (1.5 s holding the job's stdout open); a worker whose start fails because its launcher stopped as it
forked (the launcher's pipes and semaphores gone: an OSError, an EOFError) ends without a traceback."""

import atexit
import os
import sys

atexit.register(os._exit, 0)  # registered last, run first
sys.excepthook = lambda kind, *rest: None if issubclass(kind, (OSError, EOFError)) else sys.__excepthook__(kind, *rest)
