"""Issue 9 item 10: per-user limits counted in the database (429 with Retry-After), bounded job specs, and a
cancel that stops a running compile."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.compile_queue import LocalCompileQueue
from server.settings import Settings
from tests.server.factories import ADMIN_TOKEN, create_user, make_fake_model, register_model
from tests.utils.processes import exited

JOB = {"model": "tiny", "task": "sst2", "q": 2, "batch_size": 4, "steps": 3, "rank": 2}


@pytest.fixture
def settings(tmp_path: Path, db_url: str) -> Settings:  # noqa: F811 - the quotas under test, small
    return Settings(
        data_dir=tmp_path / "data",
        database_url=db_url,
        admin_token=ADMIN_TOKEN,
        max_active_jobs=3,
        max_compiles=2,
        enrollment_codes_per_hour=2,
    )


@pytest.fixture
def alice(client, tmp_path):  # noqa: F811
    register_model(client, make_fake_model(tmp_path / "model"))
    return create_user(client)


def _too_many(r, words: str) -> None:
    assert r.status_code == 429 and words in r.json()["detail"], r.text
    assert 0 < int(r.headers["retry-after"]) <= 3600


def test_active_jobs_and_compiles_in_flight_are_limited(client, queue, alice):  # noqa: F811
    queue.hold = True
    ids = [client.post("/v1/jobs", json=JOB, headers=alice).json()["id"] for _ in range(2)]
    _too_many(client.post("/v1/jobs", json=JOB, headers=alice), "compile")
    bob = create_user(client, "bob")  # another user's limits are his own
    assert client.post("/v1/jobs", json=JOB, headers=bob).status_code == 202
    queue.run_pending()
    assert client.post("/v1/jobs", json=JOB, headers=alice).status_code == 202
    _too_many(client.post("/v1/jobs", json=JOB, headers=alice), "unfinished")
    assert client.post(f"/v1/jobs/{ids[0]}/cancel", headers=alice).status_code == 200
    assert queue.cancelled == [ids[0]]  # the queue was told to stop the job's compile
    assert client.post("/v1/jobs", json=JOB, headers=alice).status_code == 202


def test_enrollment_codes_per_hour(client, alice):  # noqa: F811
    for _ in range(2):
        assert client.post("/v1/enrollment-codes", json={}, headers=alice).status_code == 201
    _too_many(client.post("/v1/enrollment-codes", json={}, headers=alice), "enrollment codes")


def test_spec_lists_are_bounded(client, alice):  # noqa: F811
    custom = {**JOB, "task": "custom", "template": "{text} It was"}
    too_many = {str(i): f" w{i}" for i in range(300)}  # over MAX_LABELS (256), well under the 64 KB body cap
    r = client.post("/v1/jobs", json={**custom, "verbalizer": too_many}, headers=alice)
    assert r.status_code == 422 and "verbalizer" in r.text
    huge = {str(i): f" w{i}" for i in range(20_000)}  # the body cap refuses it before it is parsed
    assert client.post("/v1/jobs", json={**custom, "verbalizer": huge}, headers=alice).status_code == 413
    r = client.post("/v1/jobs", json={**custom, "verbalizer": {"0": " no", "1": " y" * 500}}, headers=alice)
    assert r.status_code == 422
    r = client.post("/v1/jobs", json={**JOB, "targets": [f"t{i}" for i in range(100)]}, headers=alice)
    assert r.status_code == 422 and "targets" in r.text


def slow_build(model_dir: str, model_sha256: str, spec: dict, programs_dir: str, blobs_dir: str) -> dict:
    """A compile that takes a minute, telling the test which process runs it."""
    (Path(programs_dir) / "builder.pid").write_text(str(os.getpid()))
    time.sleep(60)
    raise AssertionError("the compile should have been stopped")


def test_cancel_stops_a_running_compile(tmp_path):
    settings = Settings(data_dir=tmp_path / "data", admin_token=ADMIN_TOKEN)
    app = create_app(settings, queue_factory=lambda s, store, _: LocalCompileQueue(s, store, 1, build=slow_build))
    with TestClient(app) as test_client:
        register_model(test_client, make_fake_model(tmp_path / "model"))
        user = create_user(test_client)
        job = test_client.post("/v1/jobs", json=JOB, headers=user).json()
        pid_file = app.state.store.programs_dir / "builder.pid"
        deadline = time.monotonic() + 60
        while not pid_file.is_file():
            assert time.monotonic() < deadline, "the compile never started"
            time.sleep(0.05)
        pid = int(pid_file.read_text())
        r = test_client.post(f"/v1/jobs/{job['id']}/cancel", headers=user)
        assert r.status_code == 200 and r.json()["status"] == "cancelled"
        deadline = time.monotonic() + 10
        while not exited(pid):
            assert time.monotonic() < deadline, "the compile worker is still running"
            time.sleep(0.05)
        assert test_client.get(f"/v1/jobs/{job['id']}", headers=user).json()["status"] == "cancelled"
