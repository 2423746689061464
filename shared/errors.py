"""Error types, the exit codes the command line maps them onto (``ExitCode``), and the one table of CLI flags.

The core names what is wrong by its *field*: the snake_case name a job spec, ``ProgramConfig`` or ``TrainConfig``
uses (``batch_size``, ``lr``), or an option's ``argparse`` dest. REST answers use that name as it is
(``batch_size: ...``); the command line shows the flag ``cli_flag`` finds for it (``argument --batch-size: ...``).
"""

from __future__ import annotations

from enum import IntEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError


class ExitCode(IntEnum):
    """What ``mobizo`` exits with (docs/contracts.md, "Command line")."""

    OK = 0
    FAILURE = 1  # a MobizoError: the message says what failed
    USAGE = 2  # a UsageError (or argparse's own): the message names the argument
    INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, as shells report it


# The flag of a field whose option is not ``--`` + the field with ``_`` → ``-`` (the REST name is the field).
FLAGS: dict[str, str] = {"program_backend": "--backend", "device_id": "--device", "init_adapter_id": "--init-adapter"}
# Per command (its words after ``mobizo``), a field reported on another flag: a batch that q does not divide is
# reported on --q, the flag one changes to fit it, by ``mobizo export`` (``mobizo train`` raises on ``q`` itself).
COMMAND_FLAGS: dict[str, dict[str, str]] = {"export": {"batch_size": "--q"}}


def cli_flag(field: str, command: str = "") -> str:
    """The option that sets ``field`` in ``command`` (its words after ``mobizo``: ``"export"``; ``""``: any)."""
    return COMMAND_FLAGS.get(command, {}).get(field) or FLAGS.get(field) or "--" + field.replace("_", "-")


class MobizoError(Exception):
    """A failure the user should read (``ExitCode.FAILURE``)."""


class UsageError(MobizoError):
    """A bad argument or option, naming its field (``ExitCode.USAGE``).

    ``str()`` is the command line's wording with the field's usual flag; ``message(command)`` is that of one
    command. Picklable (``args`` are the constructor's), so a worker process may raise it too.
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(field, reason)
        self.field = field
        self.reason = reason

    @property
    def argument(self) -> str:
        """The flag of the field in any command that has no flag of its own for it."""
        return cli_flag(self.field)

    def message(self, command: str = "") -> str:
        """``argument --flag: reason``, as ``command`` shows it."""
        return f"argument {cli_flag(self.field, command)}: {self.reason}"

    def __str__(self) -> str:
        return self.message()


class FieldError(UsageError, ValueError):
    """A ``UsageError`` that pydantic validators may raise (a ``ValueError``), worded as REST answers name it.

    The REST answer is a 422 whose message is ``field: reason``; ``usage_error`` turns the pydantic error back
    into the command line's ``UsageError``.
    """

    def __str__(self) -> str:
        return f"{self.field}: {self.reason}"


def usage_error(exc: ValidationError) -> UsageError:
    """The first error of a pydantic ``ValidationError`` as a ``UsageError`` naming its field.

    A field's own constraint names it by place (``loc``); a model's validator raises a ``FieldError`` naming it.
    """
    error = exc.errors()[0]
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, UsageError):
        return UsageError(cause.field, cause.reason)
    return UsageError(str(error["loc"][0]), error["msg"])


class SettingError(MobizoError):
    """A setting (an environment variable) the program cannot start with, named in one line (``ExitCode.USAGE``)."""


class DataError(MobizoError):
    """A data file that cannot be read fully; the message names the file and the line."""
