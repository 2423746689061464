"""Error types that the command line maps onto exit codes (2 for bad arguments, 1 for failures)."""


class MobizoError(Exception):
    """A failure the user should read (exit code 1)."""


class UsageError(MobizoError):
    """A bad argument or option: the message names it (exit code 2)."""

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
