"""The state layer's contract under races, on SQLite and on PostgreSQL: the transitions that two requests (or two
API processes) may attempt at once are decided by the database, exactly one winning.

Each race runs its two sides in threads that start together (a barrier) on sessions of their own, as two request
threads or two processes would, and is repeated so that the sides really overlap on both databases: SQLite
serializes writers (``BEGIN IMMEDIATE``), PostgreSQL decides by row locks and conditional UPDATEs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from server.accounts import SeenMemo
from server.state import closes, jobs, leases
from server.state.rounds import RoundPart, take_round_part
from server.state.sessions import lease_session
from server.tables import Device, DeviceIdentity, Job, LeasingDevice, Round, RoundClient
from shared.schemas import HeartbeatCreate
from tests.server.factories import (
    ADMIN,
    create_user,
    enroll_device,
    make_fake_model,
    register_model,
    submit_job,
)

REPEATS = 5


def _race(*sides: Callable[[], Any]) -> list[Any]:
    """Run the sides at once (each in its own thread, released together) → their results, in order."""
    barrier = threading.Barrier(len(sides))

    def run(side: Callable[[], Any]) -> Any:
        barrier.wait()
        return side()

    with ThreadPoolExecutor(len(sides)) as pool:
        return list(pool.map(run, sides))


def _world(client: TestClient, tmp_path: Path) -> dict:
    register_model(client, make_fake_model(tmp_path / "model"))
    user = create_user(client)
    return {
        "user": user,
        "phone": enroll_device(client, user, "phone"),
        "tablet": enroll_device(client, user, "tablet"),
    }


def _job_owner(client: TestClient) -> int:
    """The user id of the newest job (ids are not in the REST answers of a user's own calls)."""
    with client.app.state.sessionmaker() as session:
        return session.query(Job.user_id).order_by(Job.id.desc()).first()[0]


def _lease(sessions, user_id: int, device_id: int) -> int | None:
    with sessions() as session:
        leased = leases.lease_next(session, LeasingDevice(device_id, user_id, "executorch", None), 60)
        session.commit()
        return None if leased is None else leased.id


def _succeed(sessions, job_id: int, device_id: int) -> bool:
    with sessions() as session:
        moved = leases.succeed(session, session.get_one(Job, job_id), session.get_one(Device, device_id), 3)
        session.commit()
        return moved


def _cancel(sessions, job_id: int) -> bool:
    with sessions() as session:
        return jobs.cancel(session, session.get_one(Job, job_id))


def _beat(engine, job_id: int, device_id: int) -> bool:
    device = DeviceIdentity(device_id, user_id=0)  # the heartbeat reads the device's id alone
    return leases.heartbeat(engine, job_id, device, 60, HeartbeatCreate(step=1), SeenMemo()) is not None


def _revoke(sessions, device_id: int) -> bool:
    with sessions() as session:
        return leases.revoke_device(session, device_id)


def _begin_close(sessions, round_id: int) -> Any:
    with sessions() as session:
        return closes.begin_close(session, round_id)


def test_two_devices_leasing_one_job_get_it_once(client: TestClient, tmp_path: Path):
    world = _world(client, tmp_path)
    sessions = client.app.state.sessionmaker
    phone, tablet = world["phone"]["id"], world["tablet"]["id"]
    for _ in range(REPEATS):
        job = submit_job(client, world["user"])
        user_id = _job_owner(client)
        got = _race(partial(_lease, sessions, user_id, phone), partial(_lease, sessions, user_id, tablet))
        assert sorted(got, key=str) == [job["id"], None], got
        with sessions() as session:
            row = session.get_one(Job, job["id"])
            assert (row.status, row.leased_device_id, row.attempts) == ("running", phone if got[0] else tablet, 1)


def test_a_result_racing_a_cancel_ends_the_job_once(client: TestClient, tmp_path: Path):
    world = _world(client, tmp_path)
    sessions = client.app.state.sessionmaker
    for _ in range(REPEATS):
        job = submit_job(client, world["user"])
        assert client.post("/v1/leases", headers=world["phone"]["headers"]).json()["job_id"] == job["id"]
        succeeded, cancelled = _race(
            partial(_succeed, sessions, job["id"], world["phone"]["id"]), partial(_cancel, sessions, job["id"])
        )
        assert succeeded != cancelled, "exactly one of the two transitions applies"
        status = client.get(f"/v1/jobs/{job['id']}", headers=world["user"]).json()["status"]
        assert status == ("succeeded" if succeeded else "cancelled")


def test_a_revocation_racing_a_heartbeat_leaves_no_lease(client: TestClient, tmp_path: Path):
    world = _world(client, tmp_path)
    sessions, engine = client.app.state.sessionmaker, client.app.state.engine
    for _ in range(REPEATS):
        device = enroll_device(client, world["user"], "watch")
        job = submit_job(client, world["user"])
        assert client.post("/v1/leases", headers=device["headers"]).json()["job_id"] == job["id"]
        _, revoked = _race(partial(_beat, engine, job["id"], device["id"]), partial(_revoke, sessions, device["id"]))
        assert revoked
        with sessions() as session:
            row = session.get_one(Job, job["id"])
            assert (row.status, row.leased_device_id, row.lease_expires_at) == ("ready", None, None)
        assert not _beat(engine, job["id"], device["id"]), "a revoked device's heartbeat extends nothing"
        client.post(f"/v1/jobs/{job['id']}/cancel", headers=world["user"])  # out of the next round's way


def test_two_closers_of_one_round_close_it_once(client: TestClient, tmp_path: Path):
    world = _world(client, tmp_path)
    sessions = client.app.state.sessionmaker
    r = client.post("/v1/cohorts", json={"name": "keyboard", "model": "tiny", "task": "sst2"}, headers=ADMIN)
    cohort = r.json()["id"]
    assert client.post(f"/v1/cohorts/{cohort}/join", headers=world["user"]).status_code == 200
    for _ in range(REPEATS):
        body = {"q": 2, "batch_size": 4, "steps": 3, "rank": 2, "rounds": 1, "clients_per_round": 1}
        job = client.post(f"/v1/cohorts/{cohort}/jobs", json=body, headers=ADMIN).json()
        lease = client.post("/v1/leases", json={"eligible": True}, headers=world["phone"]["headers"]).json()
        assert lease["job_id"] == job["id"]
        with sessions() as session:
            round_id = session.query(Round.id).filter(Round.job_id == job["id"]).one()[0]
        stamps = _race(partial(_begin_close, sessions, round_id), partial(_begin_close, sessions, round_id))
        assert sum(stamp is not None for stamp in stamps) == 1, stamps
        with sessions() as session:
            row = session.get_one(Round, round_id)
            stamp = next(s for s in stamps if s is not None)
            assert row.status == "closing" and row.closing_at == stamp
            closes.abort_close(session, row, stamp, "test: ended by hand")  # the winner's stamp ends it
        assert client.get(f"/v1/jobs/{job['id']}", headers=ADMIN).json()["status"] == "failed"


def _take_part(sessions, job_id: int, user_id: int, device_id: int) -> int | None:
    with sessions() as session:
        job = session.get_one(Job, job_id)
        part = RoundPart(clients=2, timeout_s=600.0, lease_s=60, seed=lambda index, slot: slot)
        first_b = "0" * 64 if job.status == "ready" else None  # B_0's address (the transition stores no file)
        device = LeasingDevice(device_id, user_id, "executorch", None)
        client = take_round_part(session, job, device, part, first_b)
        return None if client is None else client.id


def test_two_devices_of_one_user_racing_for_a_round_part_take_it_once(client: TestClient, tmp_path: Path):
    """Both devices find the job ready and round 0 unopened: one transition opens the round and takes the user's
    part, the other opens nothing more and takes none (one part per user and round; K = 2 leaves room)."""
    world = _world(client, tmp_path)
    sessions = client.app.state.sessionmaker
    r = client.post("/v1/cohorts", json={"name": "keyboard", "model": "tiny", "task": "sst2"}, headers=ADMIN)
    cohort = r.json()["id"]
    assert client.post(f"/v1/cohorts/{cohort}/join", headers=world["user"]).status_code == 200
    phone, tablet = world["phone"]["id"], world["tablet"]["id"]
    for _ in range(REPEATS):
        body = {"q": 2, "batch_size": 4, "steps": 3, "rank": 2, "rounds": 1, "clients_per_round": 2}
        job = client.post(f"/v1/cohorts/{cohort}/jobs", json=body, headers=ADMIN).json()
        assert client.get(f"/v1/jobs/{job['id']}", headers=ADMIN).json()["status"] == "ready"
        with sessions() as session:
            member = session.get_one(Device, phone).user_id
        got = _race(*(partial(_take_part, sessions, job["id"], member, device) for device in (phone, tablet)))
        assert sum(g is not None for g in got) == 1, got
        with sessions() as session:
            rounds = session.query(Round).filter(Round.job_id == job["id"]).all()
            assert [(r.index, r.status) for r in rounds] == [(0, "open")]
            assert session.query(RoundClient).filter(RoundClient.round_id == rounds[0].id).count() == 1
            assert session.get_one(Job, job["id"]).status == "running"
        client.post(f"/v1/jobs/{job['id']}/cancel", headers=ADMIN)  # out of the next repeat's way


def _lease_session(sessions, user_id: int, device_id: int) -> int | None:
    with sessions() as session:
        leased = lease_session(session, LeasingDevice(device_id, user_id, "executorch", None), 60, 3)
        session.commit()
        return None if leased is None else leased.id


def test_two_devices_of_one_user_racing_for_a_standing_job_start_one_session(client: TestClient, tmp_path: Path):
    world = _world(client, tmp_path)
    sessions = client.app.state.sessionmaker
    phone, tablet = world["phone"]["id"], world["tablet"]["id"]
    for _ in range(REPEATS):
        standing = submit_job(client, world["user"], standing=True)
        user_id = _job_owner(client)
        got = _race(
            partial(_lease_session, sessions, user_id, phone), partial(_lease_session, sessions, user_id, tablet)
        )
        assert len([g for g in got if g is not None]) == 1, got
        with sessions() as session:
            live = session.query(Job).filter(Job.standing_job_id == standing["id"]).all()
            assert [(j.status, j.leased_device_id) for j in live] == [("running", phone if got[0] else tablet)]
        _cancel(sessions, standing["id"])  # and its session: the next standing job is the only one ready
