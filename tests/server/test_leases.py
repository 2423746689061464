"""Leases: which device gets which job, heartbeats, expiry and re-lease, bounded retries, cancellation."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import update

from server.db import begin_write
from server.state import leases
from server.tables import Job, utcnow
from tests.server.factories import (
    FAKE_PROGRAM_MB,
    create_user,
    enroll_device,
    make_fake_model,
    register_model,
    submit_job,
)


@pytest.fixture
def user(client, tmp_path):
    register_model(client, make_fake_model(tmp_path / "model"))
    return create_user(client)


def _expire(client, job_id: int) -> None:
    """Move the job's lease into the past, as if the device had vanished."""
    with client.app.state.sessionmaker() as session:
        begin_write(session)
        session.execute(update(Job).where(Job.id == job_id).values(lease_expires_at=utcnow() - timedelta(seconds=1)))
        session.commit()


def test_no_ready_job_is_204(client, user):
    phone = enroll_device(client, user)
    assert client.post("/v1/leases", headers=phone["headers"]).status_code == 204


def test_lease_hands_out_the_job_once_with_its_files(client, user):
    phone, tablet = enroll_device(client, user, "phone"), enroll_device(client, user, "tablet")
    job = submit_job(client, user)
    lease = client.post("/v1/leases", headers=phone["headers"]).json()
    assert lease["job_id"] == job["id"] and lease["attempt"] == 1
    assert lease["spec"]["answer_len"] == 1 and lease["spec"]["q"] == 2
    assert lease["program"]["url"] == f"/v1/blobs/{lease['program']['sha256']}"
    assert len(lease["weights"]["sha256"]) == 64
    assert lease["init"] is None and lease["heartbeat_s"] < 60
    assert client.post("/v1/leases", headers=tablet["headers"]).status_code == 204
    assert client.get(f"/v1/jobs/{job['id']}", headers=user).json()["status"] == "running"


def test_jobs_go_to_the_named_device_or_a_fitting_backend(client, user):
    phone = enroll_device(client, user, "phone", "executorch")
    laptop = enroll_device(client, user, "laptop", "torch")
    for_phone = submit_job(client, user, device_id=phone["id"])
    for_torch = submit_job(client, user, device_backend="torch")
    assert client.post("/v1/leases", headers=laptop["headers"]).json()["job_id"] == for_torch["id"]
    assert client.post("/v1/leases", headers=laptop["headers"]).status_code == 204
    assert client.post("/v1/leases", headers=phone["headers"]).json()["job_id"] == for_phone["id"]


def test_a_device_gets_only_jobs_that_fit_the_memory_it_reports(client, user):
    phone = enroll_device(client, user, "phone")
    job = submit_job(client, user)
    small = {"memory_mb": FAKE_PROGRAM_MB - 1}
    assert client.post("/v1/leases", json=small, headers=phone["headers"]).status_code == 204
    assert client.post("/v1/leases", headers=phone["headers"]).status_code == 204  # the last report still holds
    enough = {"memory_mb": FAKE_PROGRAM_MB, "backend": "executorch"}
    assert client.post("/v1/leases", json=enough, headers=phone["headers"]).json()["job_id"] == job["id"]


def test_lease_report_is_validated(client, user):
    phone = enroll_device(client, user, "phone")
    for bad in ({"memory_mb": -1}, {"backend": "gpu"}, {"free": 3}):
        response = client.post("/v1/leases", json=bad, headers=phone["headers"])
        assert response.status_code == 422, bad


def test_a_device_reports_its_cpu_at_enrollment_and_when_it_asks_for_work(client, user):
    """The architecture and the kernel-deciding features a device reports are stored (each feature once, in the
    vocabulary's order), replaced by the next report, kept when a report names none, and shown in the device list;
    a feature or architecture outside the vocabulary is a 422 naming the field."""
    code = client.post("/v1/enrollment-codes", json={}, headers=user).json()["code"]
    arm = {"arch": "aarch64", "features": ["i8mm", "asimd", "dotprod", "i8mm"]}
    enrolled = client.post("/v1/devices", json={"code": code, "name": "jetson", "cpu": arm})
    assert enrolled.status_code == 201, enrolled.text
    headers = {"Authorization": f"Bearer {enrolled.json()['token']}"}

    def cpu() -> dict | None:
        (device,) = client.get("/v1/devices", headers=user).json()["data"]
        return device["cpu"]

    assert cpu() == {"arch": "aarch64", "features": ["asimd", "dotprod", "i8mm"]}
    assert client.post("/v1/leases", json={"memory_mb": 100}, headers=headers).status_code == 204
    assert cpu() == {"arch": "aarch64", "features": ["asimd", "dotprod", "i8mm"]}  # not reported: kept
    sme = {"arch": "aarch64", "features": ["asimd", "dotprod", "i8mm", "sve2", "sme2"]}
    assert client.post("/v1/leases", json={"cpu": sme}, headers=headers).status_code == 204
    assert cpu() == sme
    for bad, field in (({"arch": "mips"}, "arch"), ({"arch": "aarch64", "features": ["rdrand"]}, "features")):
        response = client.post("/v1/leases", json={"cpu": bad}, headers=headers)
        assert response.status_code == 422 and f"cpu.{field}" in response.text.replace('","', "."), response.text
    assert cpu() == sme


def test_another_users_device_never_gets_the_job(client, user):
    submit_job(client, user)
    bobs_phone = enroll_device(client, create_user(client, "bob"))
    assert client.post("/v1/leases", headers=bobs_phone["headers"]).status_code == 204


def test_heartbeat_records_progress_and_extends_the_lease(client, user):
    phone = enroll_device(client, user)
    job = submit_job(client, user)
    lease = client.post("/v1/leases", headers=phone["headers"]).json()
    r = client.post(
        f"/v1/work/job-{job['id']}/heartbeat",
        json={"step": 2, "loss": 0.7, "steps_per_s": 1.5},
        headers=phone["headers"],
    )
    assert r.status_code == 200 and r.json()["cancelled"] is False
    assert r.json()["expires_at"] >= lease["expires_at"]
    progress = client.get(f"/v1/jobs/{job['id']}", headers=user).json()["progress"]
    assert progress == {"step": 2, "loss": 0.7, "steps_per_s": 1.5}


def test_heartbeat_validation_and_scoping(client, user):
    phone = enroll_device(client, user)
    job = submit_job(client, user)
    client.post("/v1/leases", headers=phone["headers"])
    r = client.post(f"/v1/work/job-{job['id']}/heartbeat", json={"step": -1}, headers=phone["headers"])
    assert r.status_code == 422
    bobs_phone = enroll_device(client, create_user(client, "bob"))
    r = client.post(f"/v1/work/job-{job['id']}/heartbeat", json={"step": 1}, headers=bobs_phone["headers"])
    assert r.status_code == 404


def test_expired_lease_is_released_to_another_device(client, user):
    phone, tablet = enroll_device(client, user, "phone"), enroll_device(client, user, "tablet")
    job = submit_job(client, user)
    client.post("/v1/leases", headers=phone["headers"])
    _expire(client, job["id"])
    second = client.post("/v1/leases", headers=tablet["headers"]).json()
    assert second["job_id"] == job["id"] and second["attempt"] == 2
    r = client.post(f"/v1/work/job-{job['id']}/heartbeat", json={"step": 5}, headers=phone["headers"])
    assert r.status_code == 409  # the first device lost its lease
    r = client.post(f"/v1/work/job-{job['id']}/heartbeat", json={"step": 1}, headers=tablet["headers"])
    assert r.status_code == 200


def test_a_job_fails_after_max_attempts_expired_leases(client, user, settings):
    phone = enroll_device(client, user)
    job = submit_job(client, user)
    for _ in range(settings.max_attempts):
        assert client.post("/v1/leases", headers=phone["headers"]).json()["job_id"] == job["id"]
        _expire(client, job["id"])
    assert client.post("/v1/leases", headers=phone["headers"]).status_code == 204
    shown = client.get(f"/v1/jobs/{job['id']}", headers=user).json()
    assert shown["status"] == "failed" and "lease expired 3 times" in shown["error"]


def test_sweeper_function_releases_without_a_lease_request(client, user):
    phone = enroll_device(client, user)
    job = submit_job(client, user)
    client.post("/v1/leases", headers=phone["headers"])
    _expire(client, job["id"])
    with client.app.state.sessionmaker() as session:
        leases.sweep_leases(session, max_attempts=3)
    assert client.get(f"/v1/jobs/{job['id']}", headers=user).json()["status"] == "ready"


def test_cancelled_job_tells_its_device_to_stop(client, user):
    phone = enroll_device(client, user)
    job = submit_job(client, user)
    client.post("/v1/leases", headers=phone["headers"])
    assert client.post(f"/v1/jobs/{job['id']}/cancel", headers=user).json()["status"] == "cancelled"
    r = client.post(f"/v1/work/job-{job['id']}/heartbeat", json={"step": 3}, headers=phone["headers"])
    assert r.status_code == 200 and r.json() == {**r.json(), "cancelled": True, "status": "cancelled"}
    assert client.post("/v1/leases", headers=phone["headers"]).status_code == 204


def test_a_device_that_cannot_finish_fails_the_job_with_its_reason(client, user):
    phone, tablet = enroll_device(client, user, "phone"), enroll_device(client, user, "tablet")
    job = submit_job(client, user)
    client.post("/v1/leases", headers=phone["headers"])
    body = {"error": "train.jsonl line 4: not JSON"}
    assert client.post(f"/v1/work/job-{job['id']}/fail", json=body, headers=tablet["headers"]).status_code == 409
    assert client.post(f"/v1/work/job-{job['id']}/fail", json=body, headers=phone["headers"]).status_code == 204
    shown = client.get(f"/v1/jobs/{job['id']}", headers=user).json()
    assert shown["status"] == "failed" and shown["error"] == f"device {phone['id']}: train.jsonl line 4: not JSON"
    assert client.post(f"/v1/work/job-{job['id']}/fail", json=body, headers=phone["headers"]).status_code == 409


def test_an_idle_population_is_paced_by_retry_after_on_204(client, user):
    from server.pace import Pace

    phones = [enroll_device(client, user, f"phone-{i}") for i in range(3)]
    for phone in phones:  # each is heard from; under the default rate (50 asks a second) nobody is told to wait
        r = client.post("/v1/leases", headers=phone["headers"])
        assert r.status_code == 204 and "retry-after" not in r.headers
    client.app.state.settings.checkin_rate = 0.5  # the population should ask once every 2 s in all
    client.app.state.pace = Pace()  # counted afresh: three devices heard from
    r = client.post("/v1/leases", headers=phones[0]["headers"])
    assert r.status_code == 204 and r.headers["retry-after"] == "6"  # 3 devices / 0.5 a second
    assert client.post(f"/v1/devices/{phones[1]['id']}/revoke", headers=user).status_code == 200  # not counted
    client.app.state.pace = Pace()
    assert client.post("/v1/leases", headers=phones[0]["headers"]).headers["retry-after"] == "4"
    client.app.state.settings.checkin_rate = 4.0  # 2 devices at 4 a second: under a second, no wait asked
    client.app.state.pace = Pace()
    assert "retry-after" not in client.post("/v1/leases", headers=phones[0]["headers"]).headers


def test_the_population_count_is_read_at_most_every_count_every_s(client, user):
    from server.pace import COUNT_EVERY_S, Pace

    now = [0.0]
    pace = Pace(clock=lambda: now[0])
    with client.app.state.sessionmaker() as session:
        assert pace.devices(session) == 0
        r = client.post("/v1/leases", headers=enroll_device(client, user)["headers"])
        assert r.status_code == 204
        now[0] = COUNT_EVERY_S / 2
        assert pace.devices(session) == 0  # as last counted
        now[0] = COUNT_EVERY_S
        assert pace.devices(session) == 1


def test_a_standing_job_starts_one_session_at_a_time_for_eligible_devices_and_cancel_ends_both(client, user):
    """A standing job is never leased itself: an eligible device gets a new session (a job of its own, naming the
    standing job, from its promoted adapter: none yet), one at a time; the standing job stays ready (waiting), and
    cancelling it cancels the session in flight."""
    phone, tablet = enroll_device(client, user, "phone"), enroll_device(client, user, "tablet")
    standing = submit_job(client, user, standing=True, sessions=2)
    assert client.post("/v1/leases", json={"eligible": False}, headers=phone["headers"]).status_code == 204
    lease = client.post("/v1/leases", json={"eligible": True}, headers=phone["headers"]).json()
    session_id = lease["job_id"]
    assert session_id != standing["id"] and lease["init"] is None and lease["spec"]["steps"] == 3
    assert client.post("/v1/leases", headers=tablet["headers"]).status_code == 204  # one session in flight
    shown = client.get(f"/v1/jobs/{standing['id']}", headers=user).json()
    assert shown["status"] == "ready" and shown["sessions_run"] == 0 and shown["adapter_id"] is None
    session = client.get(f"/v1/jobs/{session_id}", headers=user).json()
    assert session["status"] == "running" and session["standing_job_id"] == standing["id"]
    assert session["spec"]["standing"] is False and session["spec"]["sessions"] is None
    assert client.post(f"/v1/jobs/{standing['id']}/cancel", headers=user).json()["status"] == "cancelled"
    r = client.post(f"/v1/work/job-{session_id}/heartbeat", json={"step": 1}, headers=phone["headers"])
    assert r.status_code == 200 and r.json()["cancelled"] is True
    assert client.post("/v1/leases", headers=tablet["headers"]).status_code == 204


def test_a_lost_session_goes_back_to_ready_and_no_second_session_starts(client, user):
    """A session whose lease ran out is an ordinary job again (ready, for any device), not a reason to start
    another session."""
    phone, tablet = enroll_device(client, user, "phone"), enroll_device(client, user, "tablet")
    submit_job(client, user, standing=True)
    session_id = client.post("/v1/leases", headers=phone["headers"]).json()["job_id"]
    _expire(client, session_id)
    lease = client.post("/v1/leases", headers=tablet["headers"]).json()
    assert lease["job_id"] == session_id and lease["attempt"] == 2


def test_a_standing_job_whose_sessions_keep_failing_fails_with_the_last_reason(client, user, settings):
    """A device that cannot run the standing job fails each session; after ``max_attempts`` failed sessions in a
    row the standing job fails too, instead of starting a session at every poll."""
    phone = enroll_device(client, user)
    standing = submit_job(client, user, standing=True)
    body = {"error": "no training data for task 'sst2'"}
    for _ in range(settings.max_attempts):
        session_id = client.post("/v1/leases", headers=phone["headers"]).json()["job_id"]
        assert client.post(f"/v1/work/job-{session_id}/fail", json=body, headers=phone["headers"]).status_code == 204
        assert client.get(f"/v1/jobs/{standing['id']}", headers=user).json()["status"] == "ready"
    assert client.post("/v1/leases", headers=phone["headers"]).status_code == 204
    shown = client.get(f"/v1/jobs/{standing['id']}", headers=user).json()
    assert shown["status"] == "failed" and shown["error"].endswith("no training data for task 'sst2'")
    assert f"last {settings.max_attempts} sessions failed" in shown["error"]
