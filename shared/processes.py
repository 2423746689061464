"""A child process that must not outlive the process that started it (torch-free).

``die_with_parent``, called first thing in the child, asks Linux for SIGKILL when its parent dies
(``prctl(PR_SET_PDEATHSIG)``): the kernel sends it, so it works whatever the child is doing, even inside one long C
call that holds the GIL, where a thread of the child's own watching for its parent would not get to run. The
signal is tied to the parent's *thread* that started the child: a parent whose threads come and go starts its
children from one thread that lives as long as it does (``server.pool``).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from functools import cache

_PR_SET_PDEATHSIG = 1


@cache
def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl``; None where there is none (not Linux)."""
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with_parent(parent_pid: int) -> bool:
    """In a child of ``parent_pid``: be killed when the thread that started it dies; exit now if the parent is
    already gone. False where the system has no such signal (not Linux): the caller watches the parent itself."""
    prctl = _prctl()
    if prctl is None:
        return False
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the signal was asked for
        os._exit(1)
    return True


def dies_with_this_process() -> Callable[[], object] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` whose child (and what it execs: the signal is kept across exec)
    dies with this process; None where the system has no such signal. prctl is looked up here, in the parent, so
    the forked child of a threaded process only calls it. SIGKILL, not SIGHUP: a process started under ``nohup``
    passes an ignored SIGHUP on to its children, which would outlive it."""
    if _prctl() is None:
        return None
    parent = os.getpid()
    return lambda: die_with_parent(parent)
