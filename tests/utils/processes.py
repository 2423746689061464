"""Whether a process has exited, read from /proc (Linux), for tests that kill processes."""

from __future__ import annotations

from pathlib import Path


def exited(pid: int) -> bool:
    """The process has exited. A zombie not yet reaped by its parent counts as exited: it runs nothing.

    The process may be reaped while ``/proc/<pid>/stat`` is being read: opening it then fails with
    FileNotFoundError, and reading an open file with ProcessLookupError; both mean it has exited."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    # The command name in parentheses may hold spaces; the state is the first field after it.
    return stat.rsplit(")", 1)[1].split()[0] == "Z"
