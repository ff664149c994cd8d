"""The one exception type for input a user can fix (reported as one line, exit code 2), and exit codes."""

PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM: stopped on request after saving checkpoints/last.ckpt


class UserError(Exception):
    """Bad config, missing data, unreadable file: the message says what was wrong and what to do instead."""


def one_line(err: BaseException) -> str:
    """The user-facing message of `err`, also when a DataLoader worker re-raised it wrapped in a traceback."""
    text = str(err).strip()
    if "Original Traceback" in text:  # torch re-raises worker errors as "Caught X in DataLoader worker ...<tb>"
        text = text.splitlines()[-1].split(": ", 1)[-1]
    return text
