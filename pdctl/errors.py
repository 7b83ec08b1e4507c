"""The one error hierarchy of pdctl and the one table of exit codes.

Every error a user can cause is a `PdctlError` carrying a message and an optional
hint. The CLI maps the class to an exit code here and nowhere else; a traceback is
shown only with `-v`. This module knows nothing about rendering.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Documented exit codes (README, "Exit codes")."""

    OK = 0
    FAILURE = 1  # a check failed (mismatch, failed request)
    USAGE = 2  # bad topology file or bad command-line usage
    LAUNCH = 3  # a topology could not be brought up
    SKIPPED = 4  # requirements of the topology are not met on this machine
    INTERNAL = 70  # a bug in pdctl (EX_SOFTWARE)
    INTERRUPTED = 130  # Ctrl-C
    OUTPUT_CLOSED = 141  # stdout's reader went away (`pdctl ... | head`): 128 + SIGPIPE


class PdctlError(Exception):
    """An error the user can act on: what is wrong, and optionally how to fix it."""

    exit_code: ExitCode = ExitCode.FAILURE

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class UsageError(PdctlError):
    """Bad command-line usage or a bad input file."""

    exit_code = ExitCode.USAGE


class LaunchError(PdctlError):
    """A process could not be started or did not become ready."""

    exit_code = ExitCode.LAUNCH


class RequirementsUnmet(PdctlError):
    """The topology cannot run on this machine; callers report it as a skip."""

    exit_code = ExitCode.SKIPPED


class CheckFailed(PdctlError):
    """A verification found a mismatch or a failed request."""

    exit_code = ExitCode.FAILURE
