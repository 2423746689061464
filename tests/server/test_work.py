"""The work exchange: a lease names its item (``job-{id}`` or ``part-{round client id}``), and every item's
heartbeats, failure and result go to ``/v1/work/{work}/…``; names of no item, or of another device's, are 404;
malformed names 422; the routes of earlier versions 410. (Round parts through the same routes: test_federation.)"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy import event

from server.accounts import LAST_SEEN_EVERY, SeenMemo
from server.metrics import upload_kind
from server.routes.work import RETIRED
from shared.schemas import LeasePublic
from tests.server.factories import create_user, enroll_device, make_fake_model, register_model, submit_job


@pytest.fixture
def leased(client, tmp_path):
    register_model(client, make_fake_model(tmp_path / "model"))
    user = create_user(client)
    phone, tablet = enroll_device(client, user, "phone"), enroll_device(client, user, "tablet")
    job = submit_job(client, user)
    lease = LeasePublic.model_validate(client.post("/v1/leases", headers=phone["headers"]).json())
    return {"user": user, "phone": phone, "tablet": tablet, "job": job, "lease": lease}


def test_a_lease_names_its_item_and_its_work_goes_there(client, leased):
    lease, phone = leased["lease"], leased["phone"]
    assert lease.round is None and lease.work == f"job-{leased['job']['id']}"
    assert lease.work_path == f"/v1/work/job-{leased['job']['id']}"
    beat = client.post(f"{lease.work_path}/heartbeat", json={"step": 1}, headers=phone["headers"])
    assert beat.status_code == 200 and beat.json()["cancelled"] is False
    gave_up = client.post(f"{lease.work_path}/fail", json={"error": "no data"}, headers=phone["headers"])
    assert gave_up.status_code == 204
    assert client.get(f"/v1/jobs/{leased['job']['id']}", headers=leased["user"]).json()["status"] == "failed"


def test_an_item_is_only_its_devices(client, leased):
    """The holder's sibling device, and a part name with the job's number (no such round client), are 404 alike."""
    job_id, tablet, phone = leased["job"]["id"], leased["tablet"]["headers"], leased["phone"]["headers"]
    assert client.post(f"/v1/work/job-{job_id}/heartbeat", json={"step": 1}, headers=tablet).status_code == 409
    for work, headers in ((f"part-{job_id}", phone), (f"job-{job_id + 1}", phone)):
        for action, body in (("heartbeat", {"step": 1}), ("fail", {"error": "x"})):
            assert client.post(f"/v1/work/{work}/{action}", json=body, headers=headers).status_code == 404, work
        assert client.post(f"/v1/work/{work}/result", headers=headers).status_code == 404, work


@pytest.mark.parametrize("work", ["task-1", "job-0", "job-01", "job-1x", "job", "part--1", "JOB-1"])
def test_a_malformed_work_name_is_422(client, leased, work):
    answer = client.post(f"/v1/work/{work}/heartbeat", json={"step": 1}, headers=leased["phone"]["headers"])
    assert answer.status_code == 422 and answer.json()["detail"][0]["loc"] == ["path", "work"]


def test_the_routes_of_earlier_versions_are_gone(client, leased):
    job_id = leased["job"]["id"]
    for path in RETIRED:
        concrete = path.replace("{job_id}", str(job_id)).replace("{client_id}", "1")
        answer = client.post(concrete, json={"step": 1}, headers=leased["phone"]["headers"])
        assert answer.status_code == 410 and "/v1/work/{work}" in answer.json()["detail"], path
    assert client.get(f"/v1/jobs/{job_id}", headers=leased["user"]).json()["status"] == "running"  # nothing done


def test_uploads_are_counted_by_the_kind_of_their_item():
    assert upload_kind("/v1/work/job-3/result") == "job"
    assert upload_kind("/v1/work/part-3/result") == "round"


@contextmanager
def device_row_writes(app) -> Iterator[list[str]]:
    """The UPDATE statements on the devices table that the app's engine sends while the block runs; ``app.state.seen``
    on a clock the test moves (``clock[0]``, seconds)."""
    clock = [0.0]
    app.state.seen = SeenMemo(clock=lambda: clock[0])
    writes: list[str] = []

    def count(conn, cursor, statement, *args) -> None:
        if statement.lstrip().upper().startswith("UPDATE DEVICES"):
            writes.append(statement)

    event.listen(app.state.engine, "before_cursor_execute", count)
    try:
        yield writes, clock
    finally:
        event.remove(app.state.engine, "before_cursor_execute", count)


def beats_write_the_device_once_an_interval(client, path: str, headers: dict) -> None:
    """Five heartbeats in a row record the device as seen once (the first: nothing recorded it in this process
    yet), not once each; a heartbeat an interval later records it again."""
    with device_row_writes(client.app) as (writes, clock):
        for _ in range(5):
            answer = client.post(path, json={"step": 1}, headers=headers)
            assert answer.status_code == 200 and answer.json()["cancelled"] is False, answer.text
        assert len(writes) == 1, writes
        clock[0] += LAST_SEEN_EVERY.total_seconds()
        assert client.post(path, json={"step": 2}, headers=headers).status_code == 200
        assert len(writes) == 2, writes


def test_a_job_heartbeat_records_its_device_as_seen_once_an_interval(client, leased):
    beats_write_the_device_once_an_interval(
        client, f"{leased['lease'].work_path}/heartbeat", leased["phone"]["headers"]
    )
