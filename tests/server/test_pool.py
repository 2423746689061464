"""Worker processes: results and exceptions cross the process boundary; a dead worker is replaced."""

from __future__ import annotations

import os
import threading
import time

import pytest

from server.pool import WorkCancelled, WorkerDied, WorkerPool, WorkTimedOut
from server.verify import ResultRejected


def _square(x: int) -> int:
    return x * x


def _reject() -> None:
    raise ResultRejected("log", "line 3: not JSON")


def _die() -> None:
    os._exit(3)


def test_pool_runs_tasks_and_survives_a_dead_worker():
    pool = WorkerPool(1)
    try:
        assert pool.run(_square, 7) == 49
        with pytest.raises(ResultRejected) as info:
            pool.run(_reject)
        assert (info.value.field, info.value.message) == ("log", "line 3: not JSON")
        with pytest.raises(WorkerDied):
            pool.run(_die)
        assert pool.run(_square, 3) == 9  # a fresh pool took over
    finally:
        pool.close()


def _sleep(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def test_a_timeout_stops_the_work_and_the_next_task_runs():
    """The timed-out task's process is killed, not left running; the slot serves the next task at once."""
    pool = WorkerPool(1)
    try:
        first = pool.run(_sleep, 0)
        start = time.monotonic()
        with pytest.raises(WorkTimedOut):
            pool.run(_sleep, 60, timeout=0.5)
        with pytest.raises(ProcessLookupError):
            os.kill(first, 0)  # the worker that ran past its timeout is gone
        assert pool.run(_square, 4) == 16 and time.monotonic() - start < 30
    finally:
        pool.close()


def _imported(name: str) -> bool:
    import sys

    return name in sys.modules


def test_a_workers_preload_is_imported_before_its_first_task_and_outside_its_timeout(tmp_path, monkeypatch):
    """A module that takes 3 s to import, preloaded: the first task in a fresh worker finds it imported and is done
    well within a 1 s timeout, which the import alone would have overrun."""
    (tmp_path / "mobizo_slow_import.py").write_text("import time\ntime.sleep(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # spawn hands the parent's sys.path to the child
    pool = WorkerPool(1, preload=("mobizo_slow_import", __name__))  # and the task's own module, as the server does
    try:
        start = time.monotonic()
        assert pool.run(_imported, "mobizo_slow_import", timeout=1.0)
        assert time.monotonic() - start >= 3  # the import did run, before the task
        assert not _imported("mobizo_slow_import")  # in the worker, not here
    finally:
        pool.close()


def test_a_worker_whose_preload_fails_reports_it_at_once():
    pool = WorkerPool(1, preload=("mobizo_no_such_module",))
    try:
        start = time.monotonic()
        with pytest.raises(WorkerDied, match="mobizo_no_such_module"):
            pool.run(_square, 2)
        assert time.monotonic() - start < 60  # the process exited: nobody waits for the start-up bound
    finally:
        pool.close()


def test_cancel_kills_the_task_by_key():
    pool = WorkerPool(2)
    try:
        errors: list[BaseException] = []

        def run() -> None:
            try:
                pool.run(_sleep, 60, key="job-1")
            except BaseException as exc:  # noqa: BLE001 - the test inspects it
                errors.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        deadline = time.monotonic() + 30
        while not pool.cancel("job-1"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        thread.join(10)
        assert [type(e) for e in errors] == [WorkCancelled]
        assert not pool.cancel("job-1") and pool.run(_square, 5) == 25
    finally:
        pool.close()


def test_the_server_process_does_not_import_torch():
    """Routes and queue import no torch: a fresh interpreter that builds the app has none loaded."""
    import subprocess
    import sys

    code = (
        "import sys; from server.app import create_app; from server.settings import Settings; "
        "create_app(Settings(database_url='sqlite://')); print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    assert out.stdout.strip() == "False"


def _spin(marker: str) -> None:
    """Say so, then hold the GIL for hours: one C call (``sum`` over a range) that lets no other thread run."""
    from pathlib import Path

    Path(marker).write_text("spinning")
    sum(range(10**13))


_PARENT = """
import os, sys, threading, time
from server.pool import WorkerPool
from tests.server.test_pool import _spin
pool = WorkerPool(1)
print(pool.run(os.getpid), flush=True)
threading.Thread(target=pool.run, args=(_spin, sys.argv[1]), daemon=True).start()
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    """The process has exited (a zombie left to a parent that does not reap it counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_a_worker_busy_in_one_long_c_call_dies_with_a_killed_server(tmp_path):
    """SIGKILL of the server process (no chance to stop its pool) ends its worker at once, even one inside a long C
    call that holds the GIL (a thread of the worker's own, watching for its parent, would not run until it
    returns): the kernel's parent-death signal does it."""
    import signal
    import subprocess
    import sys

    from tests.server.live import REPO

    marker = tmp_path / "spinning"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, str(marker)], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
    )
    worker = int(parent.stdout.readline())
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert time.monotonic() < deadline and parent.poll() is None, "the worker never began its task"
            time.sleep(0.05)
        parent.kill()
        parent.wait()
        killed = time.monotonic()
        while not _gone(worker) and time.monotonic() - killed < 10:
            time.sleep(0.02)
        assert _gone(worker), "the worker outlived the server by 10 s"
        assert time.monotonic() - killed < 1.0
    finally:
        if not _gone(worker):
            os.kill(worker, signal.SIGKILL)
