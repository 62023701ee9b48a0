"""The one error family: a `UserError` is something the user can fix (a bad field, a missing path); it is reported
as one line `deepseek-ds: error: ...` (plus its hint) and exit status 2 (1 for a LaunchError). Anything else is
a bug and keeps its traceback. Subclasses stay ValueErrors so `except ValueError` callers (and tests) keep working."""

from __future__ import annotations

import sys
from collections.abc import Callable

USER_ERROR_EXIT = 2


class UserError(ValueError):
    """A mistake in the input, with an optional hint naming the fix."""

    exit_status = USER_ERROR_EXIT

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint

    def __str__(self) -> str:
        message = super().__str__()
        return f"{message} ({self.hint})" if self.hint else message


def format_user_error(error: BaseException) -> str:
    """The single line every entry point prints for a user error."""
    return f"deepseek-ds: error: {error}"


def report_user_error(error: BaseException) -> int:
    """Print `error` the one way and return the exit status to use (2 unless its class says otherwise)."""
    print(format_user_error(error), file=sys.stderr, flush=True)
    return getattr(error, "exit_status", USER_ERROR_EXIT)


def run_command(command: Callable[[], int | None]) -> int:
    """Every entry point's outermost call: a UserError becomes its one-line report and exit status; any other
    exception propagates with its traceback (it is a bug)."""
    try:
        return int(command() or 0)
    except UserError as error:
        return report_user_error(error)


class LaunchError(UserError):
    """A launched job (the `deepspeed` launcher and its ranks) failed or could not start; the message says where
    its log is. Exit status 1, as for preflight's failed checks: the input was accepted, the job did not succeed."""

    exit_status = 1
