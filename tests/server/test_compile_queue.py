"""The local compile queue drives jobs through compiling → ready/failed with real worker processes."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.compile_queue import LocalCompileQueue
from tests.server.factories import create_user, make_fake_model, program_config, register_model, submit_job
from tests.utils.manifests import fake_manifest


def build_fake(model_dir: str, model_sha: str, spec: dict, programs_dir: str, blobs_dir: str) -> dict:
    """Stands in for ``build_program`` in the worker: files and a manifest, or the failure a spec asks for."""
    if spec["steps"] == 13:
        raise RuntimeError("export ran out of memory")
    key = hashlib.sha256(f"{model_sha}{spec['q']}".encode()).hexdigest()
    files = {}
    for entry, path in (
        ("pte", Path(programs_dir) / key / "program.pte"),
        ("ptd", Path(blobs_dir) / "w.ptd"),
        ("tokenizer", Path(blobs_dir) / "t.json"),
    ):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(entry.encode())
        files[entry] = {"file": path.name, "sha256": hashlib.sha256(entry.encode()).hexdigest(), "size": len(entry)}
    return {"key": key, "manifest": fake_manifest(program_config(spec, 1), files), "answer_len": 1}


@pytest.fixture
def real_queue_client(settings, tmp_path):
    app = create_app(settings, queue_factory=lambda s, st, cfg: LocalCompileQueue(s, st, 1, build_fake))
    with TestClient(app) as test_client:
        register_model(test_client, make_fake_model(tmp_path / "model"))
        yield test_client


def _settled(client, user, job_id: int) -> dict:
    for _ in range(600):
        job = client.get(f"/v1/jobs/{job_id}", headers=user).json()
        if job["status"] not in ("queued", "compiling"):
            return job
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} never left {job['status']}")


def test_jobs_compile_in_a_worker_and_share_programs(real_queue_client):
    client = real_queue_client
    user = create_user(client)
    first, second = submit_job(client, user), submit_job(client, user)
    failing = submit_job(client, user, steps=13)
    assert _settled(client, user, first["id"])["status"] == "ready"
    assert _settled(client, user, second["id"])["status"] == "ready"
    failed = _settled(client, user, failing["id"])
    assert failed["status"] == "failed" and "RuntimeError: export ran out of memory" in failed["error"]
    with client.app.state.sessionmaker() as session:
        from sqlalchemy import func, select

        from server.tables import Program

        assert session.scalar(select(func.count(Program.id))) == 1  # same config, one program row


def test_jobs_left_unfinished_by_a_previous_run_are_compiled_on_start(settings, tmp_path):
    from tests.server.factories import FakeCompileQueue

    held = FakeCompileQueue()
    held.hold = True
    with TestClient(create_app(settings, queue_factory=held.bind)) as before:
        register_model(before, make_fake_model(tmp_path / "model"))
        user = create_user(before)
        job = submit_job(before, user)
    app = create_app(settings, queue_factory=lambda s, st, cfg: LocalCompileQueue(s, st, 1, build_fake))
    with TestClient(app) as after:
        assert _settled(after, user, job["id"])["status"] == "ready"


def test_an_export_that_cannot_fit_fails_its_job_naming_the_need(settings, tmp_path, tiny_model_dir):
    """The compile worker checks its memory budget before exporting (the real build_program, the default queue)."""
    from shared.memory import export_need_mb
    from shared.model_files import float32_bytes

    need = export_need_mb(float32_bytes(tiny_model_dir))
    limit = need // 2  # the estimate for the tiny model is about 1.5 GB; half of it cannot fit
    with TestClient(create_app(settings.model_copy(update={"compile_memory_mb": limit}))) as client:
        register_model(client, tiny_model_dir)
        user = create_user(client)
        failed = _settled(client, user, submit_job(client, user)["id"])
    assert failed["status"] == "failed"
    assert f"needs about {need} MB of memory and {limit} MB is MOBIZO_COMPILE_MEMORY_MB" in failed["error"]
    assert not list((settings.data_dir).rglob("*.pte"))  # refused before exporting anything


def test_a_duplicate_task_leaves_a_compiling_job_alone_and_a_redelivery_takes_it_over(client, queue, tmp_path):
    """What makes the Celery task idempotent (``compile_job``): only a redelivered task resumes a compiling job."""
    from server.compile_queue import compile_job
    from server.state import jobs

    register_model(client, make_fake_model(tmp_path / "model"))
    user = create_user(client)
    queue.hold = True
    job_id = submit_job(client, user)["id"]
    sessions = client.app.state.sessionmaker
    exports: list[int] = []

    def export(work):
        exports.append(work.job_id)
        return queue._build(work.spec, work.model_sha256, work.model_dir)

    with sessions() as session:
        assert jobs.start_compiling(session, job_id) is not None  # a worker took it ...
    compile_job(sessions, job_id, export)  # ... and a duplicate delivery arrives
    assert exports == [] and client.get(f"/v1/jobs/{job_id}", headers=user).json()["status"] == "compiling"
    compile_job(sessions, job_id, export, resume=True)  # the worker died: the broker redelivers
    assert exports == [job_id] and client.get(f"/v1/jobs/{job_id}", headers=user).json()["status"] == "ready"
    compile_job(sessions, job_id, export, resume=True)  # a late copy of a finished job
    assert exports == [job_id]

    cancelled = submit_job(client, user)["id"]
    assert client.post(f"/v1/jobs/{cancelled}/cancel", headers=user).json()["status"] == "cancelled"
    compile_job(sessions, cancelled, export, resume=True)
    assert exports == [job_id] and client.get(f"/v1/jobs/{cancelled}", headers=user).json()["status"] == "cancelled"
