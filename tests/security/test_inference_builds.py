"""Inference builds must not starve job compiles: bounded per device, per user and in all (429 with the reason),
and run behind every job waiting to compile.

One device once queued 200 inference builds in 0.6 s, and another tenant's new job stayed ``compiling`` for minutes.
"""

from __future__ import annotations

import threading
import time

import pytest

from server import compile_queue
from server.compile_queue import LocalCompileQueue
from server.tables import Job
from tests.server.factories import FakeCompileQueue, create_user, enroll_device, make_fake_model, register_model
from tests.server.factories import submit_job as submit


class HeldBuilds(FakeCompileQueue):
    """Inference builds that stay in flight until the test releases them (then fail: nothing is built)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def build_inference(self, model_dir, model_sha256, config, key):
        self.release.wait(60)
        raise RuntimeError("released")


@pytest.fixture
def queue() -> HeldBuilds:
    return HeldBuilds()


def _ask(client, device, rank: int):
    body = {"model": "tiny", "config": {"rank": rank}}
    return client.post("/v1/device/inference", json=body, headers=device["headers"])


def test_builds_are_bounded_per_device_per_user_and_in_all(client, queue, tmp_path):
    register_model(client, make_fake_model(tmp_path / "model"))
    alice, bob, carol = (create_user(client, name) for name in ("alice", "bob", "carol"))
    phone, tablet, laptop = (enroll_device(client, alice, name) for name in ("phone", "tablet", "laptop"))
    try:
        assert _ask(client, phone, 1).status_code == 503  # building
        assert _ask(client, phone, 1).status_code == 503  # the same program: no second build, no refusal
        second = _ask(client, phone, 2)
        assert second.status_code == 429 and "this device has 1" in second.json()["detail"]
        assert int(second.headers["retry-after"]) >= 1
        assert _ask(client, tablet, 1).status_code == 503  # someone's build of it already runs: free
        assert _ask(client, tablet, 2).status_code == 503
        third = _ask(client, laptop, 3)
        assert third.status_code == 429 and "your devices have 2" in third.json()["detail"]
        bobs = [enroll_device(client, bob, f"b{i}") for i in range(2)]
        assert [_ask(client, d, 4 + i).status_code for i, d in enumerate(bobs)] == [503, 503]
        full = _ask(client, enroll_device(client, carol), 8)
        assert full.status_code == 429 and "the server is building 4" in full.json()["detail"]
    finally:
        queue.release.set()


def test_an_inference_build_waits_behind_a_compiling_job(client, queue, tmp_path, monkeypatch):
    """A real compile worker holds a job ``compiling``; an inference build asked meanwhile starts only after it."""
    register_model(client, make_fake_model(tmp_path / "model"))
    user = create_user(client)
    queue.hold = True  # the app's own queue leaves the job queued: the local queue below compiles it
    job_id = submit(client, user)["id"]
    gate = tmp_path / "gate"
    monkeypatch.setenv("MOBIZO_TEST_GATE", str(gate))
    sessions = client.app.state.sessionmaker

    def status() -> str:
        with sessions() as session:
            return session.get_one(Job, job_id).status

    started_with: list[str] = []

    def export(store, run, model_dir, model_sha256, config, key):
        started_with.append(status())
        return {}

    monkeypatch.setattr(compile_queue, "export_inference", export)
    from tests.utils.gated_build import wait_then_fail

    local = LocalCompileQueue(sessions, client.app.state.store, 1, build=wait_then_fail)
    try:
        local.submit(job_id)
        deadline = time.monotonic() + 120
        while status() != "compiling":
            assert time.monotonic() < deadline, "the job did not start compiling"
            time.sleep(0.05)
        build = threading.Thread(target=local.build_inference, args=("m", "sha", {}, "key"))
        build.start()
        build.join(0.5)  # not a timing bound: the build may not start while the job compiles, however long that is
        assert started_with == [] and build.is_alive()
        gate.touch()
        build.join(120)
        assert started_with == ["failed"]  # the gated build failed the job; only then did the inference build run
    finally:
        gate.touch()
        local.close()
