"""A verified result's files are published (hashed, fsynced, renamed; put in the bucket where there is one) before
the unit of work that records them opens, for a job's result and a round part's alike: file I/O never holds the
write lock. Over a real server (uvicorn on loopback, SQLite): while an upload's files are being stored, another
device's heartbeat, itself a write, is answered at once. Were the store called inside the recording transaction,
the heartbeat would wait for the writer turn the upload holds (up to the 30 s busy timeout) and the test's 10 s
client would give up.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server.settings import Settings
from server.store import ArtifactStore
from shared.schemas import LeasePublic
from tests.security.servers import app_server
from tests.server.factories import (
    ADMIN,
    ADMIN_TOKEN,
    FakeCompileQueue,
    b_flat_bytes,
    create_user,
    enroll_device,
    fake_training,
    make_fake_model,
    register_model,
    submit_job,
    upload,
)
from tests.server.test_federation import HYPER, report

HEARTBEAT_WAIT_S = 10.0


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, httpx.Client]]:
    settings = Settings(
        data_dir=tmp_path / "data", database_url=f"sqlite:///{tmp_path / 'mobizo.db'}", admin_token=ADMIN_TOKEN
    )
    with app_server(settings, FakeCompileQueue()) as (url, _app), httpx.Client(base_url=url, timeout=60) as http:
        register_model(http, make_fake_model(tmp_path / "model"))
        yield url, http


def _heartbeat_during_keep(monkeypatch, url: str, path: str, headers: dict) -> list[tuple[int | str, float]]:
    """Every ``ArtifactStore.keep`` first sends a heartbeat of another device (``path``) and waits for its answer
    → (status or error, seconds) per keep."""
    answers: list[tuple[int | str, float]] = []
    original = ArtifactStore.keep

    def keep(self, src, kind, suffix):
        start = time.monotonic()
        try:
            with httpx.Client(base_url=url, timeout=HEARTBEAT_WAIT_S) as other:
                answers.append((other.post(path, json={"step": 1}, headers=headers).status_code, 0.0))
        except httpx.HTTPError as error:
            answers.append((type(error).__name__, 0.0))
        answers[-1] = (answers[-1][0], time.monotonic() - start)
        return original(self, src, kind, suffix)

    monkeypatch.setattr(ArtifactStore, "keep", keep)
    return answers


def test_a_jobs_files_are_published_before_its_result_is_recorded(server, monkeypatch):
    url, http = server
    user = create_user(http)
    phone, tablet = enroll_device(http, user, "phone"), enroll_device(http, user, "tablet")
    jobs = [submit_job(http, user), submit_job(http, user)]
    phone_lease = http.post("/v1/leases", headers=phone["headers"]).json()
    tablet_lease = LeasePublic.model_validate(http.post("/v1/leases", headers=tablet["headers"]).json())
    assert {phone_lease["job_id"], tablet_lease.job_id} == {job["id"] for job in jobs}
    b, log = fake_training(phone_lease["spec"], phone_lease["manifest"]["lora_size"])
    answers = _heartbeat_during_keep(monkeypatch, url, f"{tablet_lease.work_path}/heartbeat", tablet["headers"])
    r = upload(http, phone, phone_lease["job_id"], b_flat_bytes(b), log)
    assert r.status_code == 201, r.text
    assert len(answers) == 3  # the replayed B, the log, the archive
    assert all(status == 200 and seconds < HEARTBEAT_WAIT_S for status, seconds in answers), answers


def test_a_round_parts_files_are_published_before_its_report_is_recorded(server, monkeypatch):
    url, http = server
    users = {name: create_user(http, name) for name in "ab"}
    devices = {name: enroll_device(http, key, f"phone-{name}") for name, key in users.items()}
    cohort = http.post("/v1/cohorts", json={"name": "keyboard", "model": "tiny", "task": "sst2"}, headers=ADMIN)
    for name in "ab":
        assert http.post(f"/v1/cohorts/{cohort.json()['id']}/join", headers=users[name]).status_code == 200
    job = {**HYPER, "rounds": 1, "clients_per_round": 2, "round_timeout_s": 600}
    assert http.post(f"/v1/cohorts/{cohort.json()['id']}/jobs", json=job, headers=ADMIN).status_code == 202
    leases = {name: http.post("/v1/leases", headers=devices[name]["headers"]).json() for name in "ab"}
    assert all(lease["round"] is not None for lease in leases.values()), leases
    world = {"devices": devices}
    other = LeasePublic.model_validate(leases["b"]).work_path
    answers = _heartbeat_during_keep(monkeypatch, url, f"{other}/heartbeat", devices["b"]["headers"])
    r, _ = report(http, world, "a", leases["a"], rng_seed=1)
    assert r.status_code == 201, r.text
    assert len(answers) == 2  # the replayed B, the log
    assert all(status == 200 and seconds < HEARTBEAT_WAIT_S for status, seconds in answers), answers
