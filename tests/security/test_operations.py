"""Issue 9 item 9: one server per data dir (a lock taken before anything else), workers that die with their
server even when it is SIGKILLed, and no stale spool left from a previous run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.server.factories import ADMIN_TOKEN
from tests.server.live import REPO, server_process
from tests.utils.processes import exited


def test_a_second_server_on_the_same_data_dir_refuses_to_start(tmp_path):
    data = tmp_path / "data"
    stale = [data / "tmp" / "tmpabc123" / "b_flat", data / "programs" / ".tmp-0123abcd" / "program.pte"]
    for path in stale:
        path.parent.mkdir(parents=True)
        path.write_bytes(b"left by a killed server")
    env = {"MOBIZO_DATA_DIR": str(data), "MOBIZO_ADMIN_TOKEN": ADMIN_TOKEN}
    with server_process(env, tmp_path / "first.log") as url:
        assert not any(p.parent.exists() for p in stale)  # the spool and half-built programs were cleaned
        # a database it cannot even open: the lock must be refused before the database is touched
        second = {**env, "DATABASE_URL": f"sqlite:///{tmp_path / 'missing' / 'x.db'}"}
        with pytest.raises(RuntimeError, match="another mobizo server is using"):
            with server_process(second, tmp_path / "second.log"):
                pass
        assert httpx.get(f"{url}/healthz").status_code == 200
    with server_process(env, tmp_path / "third.log"):  # the lock went with the first server
        pass


POOL_SCRIPT = """
import os, sys, time
from server.pool import WorkerPool
pool = WorkerPool(2)
print(pool.run(os.getpid), flush=True)
time.sleep(600)
"""


def test_workers_die_with_a_sigkilled_server():
    proc = subprocess.Popen(
        [sys.executable, "-c", POOL_SCRIPT],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        worker = int(proc.stdout.readline())
        assert not exited(worker)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 10
    while not exited(worker):
        assert time.monotonic() < deadline, f"worker {worker} outlived its server"
        time.sleep(0.1)


def test_stopping_the_server_kills_its_compile_and_leaves_the_job_for_recovery(tmp_path):
    from fastapi.testclient import TestClient
    from sqlalchemy import select

    from server.app import create_app
    from server.compile_queue import LocalCompileQueue
    from server.db import make_engine
    from server.settings import Settings
    from server.tables import Job
    from tests.security.test_quotas import JOB, slow_build
    from tests.server.factories import create_user, make_fake_model, register_model

    settings = Settings(data_dir=tmp_path / "data", admin_token=ADMIN_TOKEN)
    app = create_app(settings, queue_factory=lambda s, store, _: LocalCompileQueue(s, store, 1, build=slow_build))
    with TestClient(app) as client:
        register_model(client, make_fake_model(tmp_path / "model"))
        client.post("/v1/jobs", json=JOB, headers=create_user(client))
        pid_file = app.state.store.programs_dir / "builder.pid"
        deadline = time.monotonic() + 60
        while not pid_file.is_file():
            assert time.monotonic() < deadline, "the compile never started"
            time.sleep(0.05)
    worker = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while not exited(worker):
        assert time.monotonic() < deadline, "the compile worker outlived the server"
        time.sleep(0.05)
    time.sleep(0.5)  # the driver thread has seen its worker die
    engine = make_engine(settings.db_url)
    try:
        with engine.connect() as conn:
            assert list(conn.scalars(select(Job.status))) == ["compiling"]
    finally:
        engine.dispose()
