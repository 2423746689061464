"""Error types and the exit codes the command line maps them onto (``ExitCode``)."""

from enum import IntEnum


class ExitCode(IntEnum):
    """What ``mobizo`` exits with (interfaces.md §1)."""

    OK = 0
    FAILURE = 1  # a MobizoError: the message says what failed
    USAGE = 2  # a UsageError (or argparse's own): the message names the argument
    INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, as shells report it


class MobizoError(Exception):
    """A failure the user should read (``ExitCode.FAILURE``)."""


class UsageError(MobizoError):
    """A bad argument or option: the message names it (``ExitCode.USAGE``)."""

    def __init__(self, argument: str, reason: str) -> None:
        super().__init__(f"argument {argument}: {reason}")
        self.argument = argument
        self.reason = reason


class DataError(MobizoError):
    """A data file that cannot be read fully; the message names the file and the line."""


class FieldError(ValueError):
    """A value that breaks a rule, naming the field (a job spec's field; the CLI flag of the same name).

    A ``ValueError``, so pydantic validators may raise it (the REST answer is a 422 naming the field); picklable,
    so a worker process may raise it too.
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(field, reason)
        self.field = field
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.field}: {self.reason}"
