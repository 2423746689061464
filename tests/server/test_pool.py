"""Worker processes: results and exceptions cross the process boundary; a dead worker is replaced."""

from __future__ import annotations

import os

import pytest

from server.pool import WorkerDied, WorkerPool
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
