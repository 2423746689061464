"""Worker processes for torch work (export, replay, archives) whose tasks can be stopped: by a timeout, by a cancel,
or by the server dying.

Each of the pool's ``workers`` slots is one process that runs one task at a time. A task that runs past its
timeout, or whose key is cancelled (``cancel``), has its process killed; the slot starts a fresh process for the
next task, so one runaway task costs one slot for the length of the timeout and never the pool. A fresh process
first imports the pool's ``preload`` modules (torch: seconds on a slow machine) and says so; a task's timeout
counts from then, so it measures the task, not the start of the process that runs it. A worker killed
from outside (out of memory) is replaced the same way and its task reports ``WorkerDied``.

Processes are started with ``spawn``: forking a server that runs threads (uvicorn's thread pool, SQLAlchemy's
connection pool) can copy held locks into the child. Every worker dies with the server, even after a SIGKILL that
left no chance to stop it, at once: the kernel kills it when its parent dies (``shared.processes.die_with_parent``,
``prctl(PR_SET_PDEATHSIG)``), whatever it is doing. That signal is tied to the thread that started the worker and
the server's threads come and go, so every worker of the process is started by one thread that lives as long as
the process (``_STARTER``). Where there is no such signal (not Linux), a thread of the worker watches its parent's
pid instead, every ``PARENT_POLL_S``, and can only act between the task's Python steps.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import Any, TypeVar

T = TypeVar("T")
PARENT_POLL_S = 1.0
START_TIMEOUT_S = 600.0  # a fresh worker's imports, before its first task; not counted in the task's timeout
READY = "ready"
# Workers run below the API process's priority: a replay or an export that has the CPU yields it to requests at once,
# and on an idle machine runs as fast as before. With workers at the same priority, six devices keeping the verify
# workers busy doubled another tenant's p95 on 2 cores (benchmarks/fairness.py).
NICENESS = 10


class WorkerDied(RuntimeError):
    """The worker process running the task exited (killed, out of memory, crashed)."""


class WorkTimedOut(TimeoutError):
    """The task ran past its timeout; its process was killed."""


class WorkCancelled(RuntimeError):
    """The task was cancelled (``WorkerPool.cancel``); its process was killed."""


class OwnerBusy(RuntimeError):
    """The task's owner already has ``per_owner`` tasks running or waiting; nothing was started."""


def _exit_with_parent(parent_pid: int) -> None:
    """In the worker: a daemon thread that ends the process once its parent is gone (reparented)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _serve(conn: Connection, parent_pid: int, preload: tuple[str, ...]) -> None:
    """The worker's loop: die with the server, lower its priority (``NICENESS``), import ``preload``, send
    ``READY``; then receive ``(fn, args)``, send back ``(True, result)`` or ``(False, exception)``."""
    import importlib

    from shared.processes import die_with_parent

    if not die_with_parent(parent_pid):
        _exit_with_parent(parent_pid)
    os.nice(NICENESS)
    for name in preload:
        importlib.import_module(name)
    conn.send(READY)
    while True:
        try:
            fn, args = conn.recv()
        except EOFError:
            return
        try:
            reply = (True, fn(*args))
        except Exception as exc:  # any failure of the task is its caller's to handle
            reply = (False, exc)
        try:
            conn.send(reply)
        except Exception as exc:  # an unpicklable result or exception
            conn.send((False, RuntimeError(f"{type(exc).__name__}: {exc}")))


# Starts every worker process of this process, from a thread that lives as long as the process does: a worker's
# parent-death signal fires when the thread that started it ends (``shared.processes``).
_STARTER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="worker-starter")


class _Worker:
    """One process and the pipe to it."""

    def __init__(self, preload: tuple[str, ...] = ()) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, os.getpid(), preload), name="mobizo-worker", daemon=True)
        _STARTER.submit(self.process.start).result()
        child.close()
        self.cancelled = False
        self.broken = False
        self.ready = False
        self.preload = preload

    def _wait_ready(self) -> None:
        """Until the process has imported its preload (once per process; not part of any task's timeout)."""
        if self.ready:
            return
        try:
            started = self.conn.poll(START_TIMEOUT_S) and self.conn.recv() == READY
        except (EOFError, OSError):
            started = False
        if not started:
            self.kill()
            if self.cancelled:
                raise WorkCancelled("the task was cancelled")
            raise WorkerDied(
                f"the worker process did not start: it exited (a preload import failed?) or took over "
                f"{START_TIMEOUT_S:g} s to import {', '.join(self.preload) or 'nothing'}"
            )
        self.ready = True

    def call(self, fn: Callable[..., T], args: tuple, timeout: float | None) -> T:
        self._wait_ready()
        try:
            self.conn.send((fn, args))
        except OSError:  # the process died while idle
            self.broken = True
            raise WorkerDied("the worker process had exited (out of memory?)") from None
        if not self.conn.poll(timeout):
            self.kill()
            raise WorkTimedOut(f"the task ran past its timeout of {timeout:g} s and was stopped")
        try:
            ok, value = self.conn.recv()
        except (EOFError, OSError):
            self.broken = True
            if self.cancelled:
                raise WorkCancelled("the task was cancelled") from None
            raise WorkerDied("the worker process exited before finishing (out of memory?)") from None
        if not ok:
            raise value
        return value

    def alive(self) -> bool:
        return not (self.broken or self.cancelled) and self.process.is_alive()

    def kill(self) -> None:
        self.broken = True
        self.process.kill()
        self.process.join(5)
        self.conn.close()


class OwnerLimit:
    """At most ``per_owner`` tasks of one owner (a user) running or waiting at once (None: no bound)."""

    def __init__(self, per_owner: int | None) -> None:
        self._per_owner = per_owner
        self._owners: dict[Hashable, int] = {}
        self._lock = threading.Lock()

    def held(self, owner: Hashable | None = None) -> int:
        """How many tasks of ``owner`` (None: of anyone) are running or waiting now."""
        with self._lock:
            return sum(self._owners.values()) if owner is None else self._owners.get(owner, 0)

    def full(self, owner: Hashable) -> bool:
        """Whether every one of ``owner``'s places is taken now (a ``hold`` would raise ``OwnerBusy``)."""
        with self._lock:
            return self._per_owner is not None and self._owners.get(owner, 0) >= self._per_owner

    @contextmanager
    def hold(self, owner: Hashable | None) -> Iterator[None]:
        """One of ``owner``'s places for the length of the block; ``OwnerBusy`` at once when none is free."""
        if owner is None:
            yield
            return
        with self._lock:
            if self._per_owner is not None and self._owners.get(owner, 0) >= self._per_owner:
                raise OwnerBusy(f"{self._per_owner} tasks of this owner are running or waiting")
            self._owners[owner] = self._owners.get(owner, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._owners[owner] -= 1
                if not self._owners[owner]:
                    del self._owners[owner]


class WorkerPool:
    """``workers`` slots of one process each; ``run`` waits for a free slot.

    ``per_owner`` (optional) bounds the tasks one owner (a user) has running or waiting: with fewer than
    ``workers``, one owner's slow tasks always leave a slot to everyone else. ``preload``: modules each worker
    process imports before its first task (outside the task's timeout).
    """

    def __init__(self, workers: int, per_owner: int | None = None, preload: tuple[str, ...] = ()) -> None:
        self._owners = OwnerLimit(per_owner)
        self._preload = preload
        self._free: queue.Queue[_Worker | None] = queue.Queue()
        for _ in range(workers):
            self._free.put(None)  # started on first use
        self._lock = threading.Lock()
        self._busy: dict[Hashable, _Worker] = {}
        self._all: set[_Worker] = set()
        self._closed = False

    def run(
        self,
        fn: Callable[..., T],
        *args: Any,
        timeout: float | None = None,
        key: Hashable | None = None,
        owner: Hashable | None = None,
    ) -> T:
        """Run ``fn(*args)`` in a worker and wait; exceptions raised there are raised here.

        ``timeout`` (seconds of running, not of waiting for a slot): past it the worker is killed and
        ``WorkTimedOut`` raised. ``key`` names the task for ``cancel``. ``owner``: whose task it is, for
        ``per_owner`` (``OwnerBusy`` at once when the owner has that many already).
        """
        with self._owners.hold(owner):
            return self._run(fn, args, timeout, key)

    def owner_full(self, owner: Hashable) -> bool:
        """Whether ``owner`` has ``per_owner`` tasks running or waiting now (a ``run`` would raise ``OwnerBusy``)."""
        return self._owners.full(owner)

    def _run(self, fn: Callable[..., T], args: tuple, timeout: float | None, key: Hashable | None) -> T:
        worker = self._free.get()
        try:
            with self._lock:
                if self._closed:
                    raise WorkerDied("the pool is closed")
                if worker is None or not worker.alive():
                    if worker is not None:
                        worker.conn.close()
                        self._all.discard(worker)
                    worker = _Worker(self._preload)
                    self._all.add(worker)
                if key is not None:
                    self._busy[key] = worker
            return worker.call(fn, args, timeout)
        finally:
            with self._lock:
                if key is not None and self._busy.get(key) is worker:
                    del self._busy[key]
            self._free.put(worker)

    def cancel(self, key: Hashable) -> bool:
        """Kill the worker running the task named ``key`` → whether one was running."""
        with self._lock:
            worker = self._busy.pop(key, None)
            if worker is None:
                return False
            worker.cancelled = True
        worker.process.kill()
        return True

    def close(self) -> None:
        """Kill every worker; tasks still running raise ``WorkerDied``."""
        with self._lock:
            self._closed = True
            workers = list(self._all)
        for worker in workers:
            worker.process.kill()
