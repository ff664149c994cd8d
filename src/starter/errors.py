"""How a process ends: the one exception type for input a user can fix (one line, exit code 2), a launch's failure
(WorkerFailed: its line and exit code), the exit codes, and an end without the interpreter's teardown."""

import atexit
import logging
import os
import signal
import sys
from collections.abc import Callable

USER_ERROR_EXIT_CODE = 2  # bad config, missing data: one line says what to do instead
LOST_EXIT_CODE = 124  # as timeout(1): the run stopped waiting for a process that no longer answers
PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM: stopped on request after saving checkpoints/last.ckpt
INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT: Ctrl-C
# where a process started as a rank finds its global rank, the first set: torchrun's, torch's agent's and Kubeflow's;
# srun's; jsrun's (topology.process_rank; here too, for Ctrl-C's line, said once)
RANK_VARIABLES = ("RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")


class UserError(Exception):
    """Bad config, missing data, unreadable file: the message says what was wrong and what to do instead."""


class WorkerFailed(Exception):
    """The job's exit code; `message` is None where the failing process has said why; `node`: the node whose process
    reported it in the run's store."""

    def __init__(self, message: str | None, exit_code: int, node: int | None = None):
        super().__init__(message)
        self.message, self.exit_code, self.node = message, exit_code, node


def causes(err: BaseException | None) -> list[BaseException]:
    """`err`, the error it was raised from or while handling, that one's, and so on (each once)."""
    chain = []
    while err is not None and err not in chain:
        chain.append(err)
        err = err.__cause__ or err.__context__
    return chain


def to_stderr(line: str) -> None:
    """`line` on stderr in one write: a process's threads (the watchdog's, the main one's) each say theirs whole, where
    print writes a line and its end apart."""
    sys.stderr.write(f"{line}\n")
    sys.stderr.flush()


def one_line(err: BaseException) -> str:
    """The user-facing message of `err`, also when a DataLoader worker re-raised it wrapped in a traceback."""
    text = str(err).strip()
    if "Original Traceback" in text:  # torch re-raises worker errors as "Caught X in DataLoader worker ...<tb>"
        text = text.splitlines()[-1].split(": ", 1)[-1]
    return text


def first_line(err: BaseException, named: bool = True) -> str:
    """The first line of an error's message, after its type's name ('Type: line') where `named` (some libraries'
    errors run over a hundred lines); the type's name alone for an error without a message."""
    line = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {line}" if named else line or type(err).__name__


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)  # a scheduler's: preemption, its warnings


def stop_while_starting() -> None:
    """From a script's first instruction: a stop signal while the run cannot save anything yet (imports, the config,
    the launch) ends the process with one line (said once, by rank 0), exit 143 as a stop that saved. The run's
    own handling replaces it once there is more to do (SaveOnSigterm, the launcher's agent)."""

    def stopped(signum, frame):
        if next((os.environ[v] for v in RANK_VARIABLES if v in os.environ), "0") == "0":
            name = signal.Signals(signum).name
            os.write(2, f"error: stopped by {name} while starting; nothing was saved\n".encode())
        os._exit(PREEMPTED_EXIT_CODE)

    for signum in STOP_SIGNALS:
        signal.signal(signum, stopped)


_ctrl_c: list[int] = []  # the SIGINTs this process got


def catch_ctrl_c() -> None:
    """Ctrl-C raises KeyboardInterrupt, as Python's own handler does, and is remembered: what it breaks on its way out
    (torch.save cut short mid-write raises a RuntimeError; Lightning catches the interrupt and exits 1) is its
    consequence, not a failure to report."""

    def on_ctrl_c(signum, frame):
        _ctrl_c.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_ctrl_c)


def interrupted() -> bool:
    """Whether this process got Ctrl-C (with catch_ctrl_c)."""
    return bool(_ctrl_c)


def end_without_teardown(main: Callable[[], object], interrupted_hint: str = "") -> None:
    """Runs `main`; the process then ends as usual (threads joined, exit hooks run) but without freeing every module:
    1.5-2.5 s of native destructors where Lightning is imported. Registered before the run's own exit hooks, so it
    runs after them (last registered, first run). Ctrl-C ends it with one line (and `interrupted_hint`), exit 130."""
    code = [0]
    atexit.register(lambda: _end(code[0]))
    catch_ctrl_c()
    try:
        main()
        return
    except SystemExit as stop:
        code[0] = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
        if not (interrupted() and code[0]):
            raise
    except KeyboardInterrupt:
        pass
    except BaseException:
        code[0] = 1
        raise
    code[0] = INTERRUPTED_EXIT_CODE
    # said once where torchrun or a scheduler started the ranks (topology.process_rank's rule)
    if next((os.environ[v] for v in RANK_VARIABLES if v in os.environ), "0") == "0":
        to_stderr(f"error: interrupted (Ctrl-C){interrupted_hint}")
    raise SystemExit(INTERRUPTED_EXIT_CODE)


def _end(code: int) -> None:
    logging.shutdown()  # its own hook was registered earlier (on import), so would run after this one
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
