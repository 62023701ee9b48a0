"""The one error family: a `UserError` is something the user can fix (a bad field, a missing path); it is reported
as one line `deepseek-ds: error: ...` (plus its hint) and exit status 2. Anything else is a bug and keeps its
traceback. Subclasses stay ValueErrors so `except ValueError` callers (and tests) keep working."""

from __future__ import annotations

import sys

USER_ERROR_EXIT = 2


class UserError(ValueError):
    """A mistake in the input, with an optional hint naming the fix."""

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
    """Print `error` the one way and return the exit status to use."""
    print(format_user_error(error), file=sys.stderr, flush=True)
    return USER_ERROR_EXIT
