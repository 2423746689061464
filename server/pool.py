"""A process pool for torch work (export, replay, archives) that survives a worker dying.

Processes are started with ``spawn``: forking a server that runs threads (uvicorn's thread pool, SQLAlchemy's
connection pool) can copy held locks into the child. A worker killed mid-task (out of memory, say) breaks a
``ProcessPoolExecutor`` for good, so the pool is replaced and the task reports ``WorkerDied``.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

T = TypeVar("T")


class WorkerDied(RuntimeError):
    """The worker process running the task exited (killed, out of memory, crashed)."""


class WorkerPool:
    def __init__(self, workers: int) -> None:
        self._workers = workers
        self._lock = threading.Lock()
        self._executor = self._new_executor()

    def _new_executor(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(self._workers, mp_context=multiprocessing.get_context("spawn"))

    def run(self, fn: Callable[..., T], *args: Any, timeout: float | None = None) -> T:
        """Run ``fn(*args)`` in a worker and wait; exceptions raised there are raised here."""
        with self._lock:
            executor = self._executor
        try:
            return executor.submit(fn, *args).result(timeout=timeout)
        except BrokenProcessPool:
            with self._lock:
                if self._executor is executor:
                    self._executor = self._new_executor()
            raise WorkerDied("the worker process exited before finishing (out of memory?)") from None

    def close(self) -> None:
        with self._lock:
            self._executor.shutdown(wait=False, cancel_futures=True)
