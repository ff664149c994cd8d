"""How a process ends: the one exception type for input a user can fix (one line, exit code 2), the exit codes, and
an end without the interpreter's teardown."""

import atexit
import logging
import os
import sys
from collections.abc import Callable

USER_ERROR_EXIT_CODE = 2  # bad config, missing data: one line says what to do instead
LOST_EXIT_CODE = 124  # as timeout(1): the run stopped waiting for a process that no longer answers
PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM: stopped on request after saving checkpoints/last.ckpt


class UserError(Exception):
    """Bad config, missing data, unreadable file: the message says what was wrong and what to do instead."""


def one_line(err: BaseException) -> str:
    """The user-facing message of `err`, also when a DataLoader worker re-raised it wrapped in a traceback."""
    text = str(err).strip()
    if "Original Traceback" in text:  # torch re-raises worker errors as "Caught X in DataLoader worker ...<tb>"
        text = text.splitlines()[-1].split(": ", 1)[-1]
    return text


def end_without_teardown(main: Callable[[], object]) -> None:
    """Runs `main`; the process then ends as usual (threads joined, exit hooks run) but without freeing every module:
    1.5-2.5 s of native destructors where Lightning is imported. Registered before the run's own exit hooks, so it
    runs after them (last registered, first run)."""
    code = [0]
    atexit.register(lambda: _end(code[0]))
    try:
        main()
    except SystemExit as stop:
        code[0] = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
        raise
    except BaseException as err:
        code[0] = 130 if isinstance(err, KeyboardInterrupt) else 1
        raise


def _end(code: int) -> None:
    logging.shutdown()  # its own hook was registered earlier (on import), so would run after this one
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
