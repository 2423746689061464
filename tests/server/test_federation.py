"""Cohorts, consent and federated rounds through the REST API: the app in-process (fake programs, the real replay
and aggregation), devices played by the test with logs a device could have written (``factories.fake_training``).

What the issue asks of the server: only opted-in users' eligible devices get round work, at most one per user and
K per round; each client's B is the replay of its log from B_r and the round's B_{r+1} is their aggregate in client
order, bit for bit; a round closes at K reports or at its deadline with at least M (else it is reopened once, then
the job fails with the reason); a late upload answers 409; a cohort's adapters are its members' only (404 else).
"""

from __future__ import annotations

import io
import json
import re
import threading
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from safetensors.numpy import load
from sqlalchemy import select

from tests.server.factories import (
    ADMIN,
    InlinePool,
    create_user,
    enroll_device,
    fake_training,
    make_fake_model,
    register_model,
    run_out_the_clock,
)

HYPER = {"q": 2, "batch_size": 4, "steps": 3, "rank": 2, "lr": 0.01, "eps": 0.01, "seed": 5}


@pytest.fixture
def world(client: TestClient, tmp_path: Path) -> dict:
    """A model, five users (a, b, c, d members of cohort 1 once they join; n never) with one device each."""
    import shared.replay  # noqa: F401 - import torch now, not inside a round's deadline

    register_model(client, make_fake_model(tmp_path / "model"))
    users = {name: create_user(client, name) for name in "abcdn"}
    devices = {name: enroll_device(client, key, f"phone-{name}") for name, key in users.items()}
    r = client.post("/v1/cohorts", json={"name": "keyboard", "model": "tiny", "task": "sst2"}, headers=ADMIN)
    assert r.status_code == 201, r.text
    return {"users": users, "devices": devices, "cohort": r.json()["id"]}


def join(client: TestClient, world: dict, *names: str) -> None:
    for name in names:
        r = client.post(f"/v1/cohorts/{world['cohort']}/join", headers=world["users"][name])
        assert r.status_code == 200 and r.json()["member"] is True, r.text


def submit(client: TestClient, world: dict, **federation) -> dict:
    r = client.post(f"/v1/cohorts/{world['cohort']}/jobs", json={**HYPER, **federation}, headers=ADMIN)
    assert r.status_code == 202, r.text
    return r.json()


def lease(client: TestClient, world: dict, name: str, eligible: bool | None = True):
    r = client.post("/v1/leases", json={"eligible": eligible}, headers=world["devices"][name]["headers"])
    assert r.status_code in (200, 204), r.text
    return r.json() if r.status_code == 200 else None


def init_b(client: TestClient, world: dict, name: str, lease_json: dict) -> np.ndarray:
    r = client.get(lease_json["init"]["url"], headers=world["devices"][name]["headers"])
    assert r.status_code == 200, r.text
    return load(r.content)["b_flat"]


def report(client: TestClient, world: dict, name: str, lease_json: dict, rng_seed: int):
    """Train (fake losses, real seeds) from the round's B and upload the log alone → (response, the device's B)."""
    spec, d = lease_json["spec"], lease_json["manifest"]["lora_size"]
    b, log = fake_training(spec, d, init_b(client, world, name, lease_json), seed=rng_seed)
    files = {"log": ("log.jsonl", io.BytesIO(log.encode())), "metrics": ("metrics.json", io.BytesIO(b"{}"))}
    url = f"/v1/work/part-{lease_json['round']['client_id']}/result"
    return client.post(url, files=files, headers=world["devices"][name]["headers"]), b


def rounds(client: TestClient, job_id: int) -> list[dict]:
    r = client.get(f"/v1/jobs/{job_id}/rounds", headers=ADMIN)
    assert r.status_code == 200, r.text
    return r.json()["data"]


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_cohorts_are_created_by_the_admin_and_joined_and_left_by_users(client: TestClient, world: dict):
    a = world["users"]["a"]
    body = {"name": "other", "model": "tiny", "task": "sst2"}
    assert client.post("/v1/cohorts", json=body, headers=a).status_code == 403
    assert client.post("/v1/cohorts", json={**body, "name": "keyboard"}, headers=ADMIN).status_code == 409
    r = client.post("/v1/cohorts", json={**body, "model": "nope"}, headers=ADMIN)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "model"]
    assert client.post("/v1/cohorts", json={**body, "task": "nope"}, headers=ADMIN).status_code == 422
    listed = client.get("/v1/cohorts", headers=a).json()["data"]
    assert [(c["name"], c["member"], c["members"]) for c in listed] == [("keyboard", False, 0)]
    join(client, world, "a", "a")  # joining twice is a no-op
    assert client.get("/v1/cohorts", headers=ADMIN).json()["data"][0]["members"] == 1
    r = client.post(f"/v1/cohorts/{world['cohort']}/leave", headers=a)
    assert r.json()["member"] is False and r.json()["members"] == 0
    assert client.post("/v1/cohorts/999/join", headers=a).status_code == 404
    fed = {"rounds": 1, "clients_per_round": 2}
    assert client.post(f"/v1/cohorts/{world['cohort']}/jobs", json={**HYPER, **fed}, headers=a).status_code == 403
    r = client.post(f"/v1/cohorts/{world['cohort']}/jobs", json={**HYPER, **fed, "min_clients": 3}, headers=ADMIN)
    assert r.status_code == 422 and "min_clients" in r.text


def _replay(b_r: np.ndarray, log_path: Path, optimizer: str = "sgd") -> np.ndarray:
    import torch

    from shared.replay import replay
    from shared.train_log import read_log

    return replay(torch.from_numpy(b_r.copy()), read_log(log_path), optimizer).numpy()


def _stored_b(store: Path, sha256: str) -> np.ndarray:
    return load((store / "adapters" / f"{sha256}.safetensors").read_bytes())["b_flat"]


def _recompute(store: Path, round_: dict, eta: float, beta: float = 0.0, optimizer: str = "sgd"):
    """(B_{r+1}, m_{r+1}) offline from the round's accepted logs: replay each from B_r (with the clients'
    optimizer), mean of deltas summed left to right (with server momentum BETA: plus BETA times the momentum m_r the
    round started with)."""
    b_r = _stored_b(store, round_["b_sha256"])
    reported = [c for c in round_["clients"] if c["status"] == "reported"]
    total = None
    for c in reported:
        delta = _replay(b_r, store / "logs" / f"{c['log_sha256']}.jsonl", optimizer) - b_r
        total = delta if total is None else total + delta
    update = total / np.float32(len(reported))
    if beta:
        m_r = _stored_b(store, round_["momentum_sha256"]) if round_["momentum_sha256"] else np.zeros_like(update)
        update = np.float32(beta) * m_r + update
    return b_r + np.float32(eta) * update, update


def test_rounds_are_the_aggregate_of_replayed_logs_bit_for_bit(client: TestClient, world: dict, settings):
    join(client, world, "a", "b", "c", "d")
    job = submit(client, world, rounds=2, clients_per_round=3, min_clients=2, round_timeout_s=600, global_lr=0.5)
    second = enroll_device(client, world["users"]["a"], "a-tablet")
    # round 0: three of the four members; at most one device per user, none for a non-member or an ineligible one
    assert lease(client, world, "n") is None
    leases = {name: lease(client, world, name) for name in "abc"}
    assert all(x is not None and x["round"]["index"] == 0 for x in leases.values())
    assert client.post("/v1/leases", json={}, headers=second["headers"]).status_code == 204
    assert lease(client, world, "d") is None  # K = 3 parts are taken
    seeds = {x["spec"]["seed"] for x in leases.values()}
    assert len(seeds) == 3 and all(x["spec"]["upload"] == "log" and x["spec"]["steps"] == 3 for x in leases.values())
    for i, name in enumerate("abc"):
        r, _ = report(client, world, name, leases[name], i)
        assert r.status_code == 201, r.text
    # the K-th report closed it, or the round sweeper, finding the round full first, is closing it in its thread
    wait_for(lambda: rounds(client, job["id"])[0]["status"] == "closed", 30, "round 0 to close")
    # round 1: b left; d straggles; the round closes at its deadline with M = 2 and refuses d's late upload
    assert client.post(f"/v1/cohorts/{world['cohort']}/leave", headers=world["users"]["b"]).status_code == 200
    assert lease(client, world, "b") is None
    assert lease(client, world, "d", eligible=False) is None
    leases = {name: lease(client, world, name) for name in "acd"}
    assert all(x["round"]["index"] == 1 for x in leases.values())
    for i, name in enumerate("ac"):
        assert report(client, world, name, leases[name], 10 + i)[0].status_code == 201
    shown = client.get(f"/v1/jobs/{job['id']}", headers=ADMIN).json()
    assert shown["federation_progress"]["round"] == 1 and shown["federation_progress"]["clients_reported"] == 2
    assert shown["status"] == "running"  # K = 3 not reached: the round waits for its deadline
    run_out_the_clock(settings.db_url, job["id"])
    done = wait_for(
        lambda: (j := client.get(f"/v1/jobs/{job['id']}", headers=ADMIN).json())["status"] != "running" and j,
        60,
        "the round's deadline",
    )
    assert done["status"] == "succeeded", done["error"]
    late, _ = report(client, world, "d", leases["d"], 20)
    assert late.status_code == 409 and "late" in late.text
    # every round's B is the offline recomputation from its accepted logs, and round r+1 starts from it
    listed = rounds(client, job["id"])
    assert [r["status"] for r in listed] == ["closed", "closed"]
    assert [len([c for c in r["clients"] if c["status"] == "reported"]) for r in listed] == [3, 2]
    assert world["devices"]["b"]["id"] not in {c["device_id"] for c in listed[1]["clients"]}
    a = world["users"]["a"]
    for index, round_ in enumerate(listed):
        adapter = client.get(f"/v1/adapters/{round_['adapter_id']}", headers=a).json()
        assert (adapter["cohort_id"], adapter["round"], adapter["version"]) == (world["cohort"], index, index + 1)
        stored = load((settings.data_dir / "adapters" / f"{adapter['b_sha256']}.safetensors").read_bytes())["b_flat"]
        expected = _recompute(settings.data_dir, round_, 0.5)[0]
        assert np.array_equal(stored.view(np.int32), expected.view(np.int32))
        assert np.abs(stored).max() > 0
        if index + 1 < len(listed):
            assert listed[index + 1]["b_sha256"] == adapter["b_sha256"]
    # members see and download the cohort's adapters; a non-member and a user who left get 404
    last = listed[-1]["adapter_id"]
    assert {x["id"] for x in client.get("/v1/adapters", headers=a).json()["data"]} == {r["adapter_id"] for r in listed}
    archive = client.get(f"/v1/adapters/{last}/download", headers=a)
    assert archive.status_code == 200
    with zipfile.ZipFile(io.BytesIO(archive.content)) as zf:  # the cohort's adapter carries its card too
        card = json.loads(zf.read("mobizo_card.json"))
    assert card["provenance"]["federated"] is True and card["provenance"]["device_backend"] is None
    for outsider in ("n", "b"):
        headers = world["users"][outsider]
        assert client.get(f"/v1/adapters/{last}", headers=headers).status_code == 404
        assert client.get(f"/v1/adapters/{last}/download", headers=headers).status_code == 404
        assert client.get("/v1/adapters", headers=headers).json()["count"] == 0
    # a member starts a personal job from the cohort's adapter; a non-member cannot
    personal = {"model": "tiny", "task": "sst2", **HYPER, "init_adapter_id": last}
    assert client.post("/v1/jobs", json=personal, headers=a).status_code == 202
    assert client.post("/v1/jobs", json=personal, headers=world["users"]["n"]).status_code == 404


def test_server_momentum_carries_each_rounds_aggregate_into_the_next(client: TestClient, world: dict, settings):
    """FedAvgM over three rounds, with clients running the momentum optimizer within their round (each part a fresh
    run from B_r, its state rebuilt by the replay): B_{r+1} = B_r + ETA·m_{r+1}, m_{r+1} = BETA·m_r + the mean of the
    replayed deltas, recomputed offline bit for bit; m_r is stored beside B_r."""
    join(client, world, "a", "b")
    hyper = {"rounds": 3, "clients_per_round": 2, "global_lr": 0.5, "server_momentum": 0.8, "optimizer": "momentum"}
    job = submit(client, world, **hyper)
    for index in range(3):
        leases = {name: lease(client, world, name) for name in "ab"}
        assert all(x["round"]["index"] == index and x["spec"]["optimizer"] == "momentum" for x in leases.values())
        for i, name in enumerate("ab"):
            assert report(client, world, name, leases[name], 10 * index + i)[0].status_code == 201
        wait_for(lambda i=index: rounds(client, job["id"])[i]["status"] == "closed", 30, f"round {index} to close")
    listed = rounds(client, job["id"])
    assert listed[0]["momentum_sha256"] is None and all(r["momentum_sha256"] for r in listed[1:])
    store = settings.data_dir
    for index, round_ in enumerate(listed):
        adapter = client.get(f"/v1/adapters/{round_['adapter_id']}", headers=world["users"]["a"]).json()
        b_next, m_next = _recompute(store, round_, 0.5, 0.8, "momentum")
        assert _stored_b(store, adapter["b_sha256"]).tobytes() == b_next.tobytes()
        if index + 1 < len(listed):  # round r+1 starts from B_{r+1} and m_{r+1}
            assert listed[index + 1]["b_sha256"] == adapter["b_sha256"]
            assert _stored_b(store, listed[index + 1]["momentum_sha256"]).tobytes() == m_next.tobytes()
    assert not np.array_equal(_recompute(store, listed[2], 0.5, 0.0, "momentum")[0], b_next)  # momentum counted
    assert not np.array_equal(_recompute(store, listed[2], 0.5, 0.8, "sgd")[0], b_next)  # so did the clients'


def test_a_round_short_of_m_clients_is_reopened_once_then_the_job_fails(client: TestClient, world: dict, settings):
    join(client, world, "a", "b")
    job = submit(client, world, rounds=1, clients_per_round=2, min_clients=2, round_timeout_s=600)
    assert lease(client, world, "a") is not None  # one part taken, never reported
    run_out_the_clock(settings.db_url, job["id"])
    wait_for(lambda: rounds(client, job["id"])[0]["reopened"] == 1, 60, "the round to be reopened")
    assert client.get(f"/v1/jobs/{job['id']}", headers=ADMIN).json()["status"] == "running"
    run_out_the_clock(settings.db_url, job["id"])
    failed = wait_for(
        lambda: (j := client.get(f"/v1/jobs/{job['id']}", headers=ADMIN).json())["status"] == "failed" and j,
        60,
        "the job to fail",
    )
    assert "0 of at least 2 clients reported" in failed["error"] and "reopened once" in failed["error"]
    assert rounds(client, job["id"])[0]["status"] == "failed"


class _PackagingDiesOnce(InlinePool):
    """A verify pool whose first packaging task's worker dies (as an OOM kill would); every other task runs in the
    test process."""

    def __init__(self) -> None:
        self.packagings = 0

    def run(self, fn, *args, timeout=None, key=None, owner=None):
        from server.pool import WorkerDied
        from server.verify import package_adapter

        if fn is package_adapter:
            self.packagings += 1
            if self.packagings == 1:
                raise WorkerDied("worker process died (exit code -9)")
        return fn(*args)

    def close(self) -> None:
        pass


def _finished(client: TestClient, job_id: int) -> dict:
    job = client.get(f"/v1/jobs/{job_id}", headers=ADMIN).json()
    return job if job["status"] != "running" else {}


def test_a_round_whose_packaging_worker_dies_is_closed_again(client: TestClient, world: dict):
    join(client, world, "a", "b")
    job = submit(client, world, rounds=1, clients_per_round=2, round_timeout_s=600)
    parts = {name: lease(client, world, name) for name in "ab"}
    pool = client.app.state.verify_pool = _PackagingDiesOnce()
    for i, name in enumerate("ab"):
        assert report(client, world, name, parts[name], i)[0].status_code == 201
    # the K-th report began closing the round and its packaging died: the round is open again, not failed, and
    # the sweeper closes it (it is full)
    done = wait_for(lambda: _finished(client, job["id"]), 60, "the round to be closed again")
    assert done["status"] == "succeeded", done["error"]
    assert pool.packagings == 2 and rounds(client, job["id"])[0]["status"] == "closed"


def test_a_round_left_closing_by_a_stopped_server_is_closed_by_the_next(
    client: TestClient, world: dict, settings, queue
):
    from sqlalchemy import update

    from server.app import create_app
    from server.db import make_engine
    from server.tables import Round

    join(client, world, "a", "b", "c")
    job = submit(client, world, rounds=1, clients_per_round=3, min_clients=2, round_timeout_s=600)
    parts = {name: lease(client, world, name) for name in "ab"}
    for i, name in enumerate("ab"):
        assert report(client, world, name, parts[name], i)[0].status_code == 201
    engine = make_engine(settings.db_url)
    with engine.begin() as conn:  # a server stopped while closing the round at its deadline: "closing" stays
        conn.execute(update(Round).where(Round.job_id == job["id"]).values(status="closing"))
    engine.dispose()
    with TestClient(create_app(settings, queue_factory=queue.bind)) as restarted:  # the next server's start
        restarted.app.state.verify_pool.close()
        restarted.app.state.verify_pool = InlinePool()
        assert rounds(restarted, job["id"])[0]["status"] == "open"  # reopened at start, M = 2 reports kept
        run_out_the_clock(settings.db_url, job["id"])
        done = wait_for(lambda: _finished(restarted, job["id"]), 60, "the round to be closed after the restart")
    assert done["status"] == "succeeded", done["error"]
    (closed,) = rounds(client, job["id"])
    assert closed["status"] == "closed" and len([c for c in closed["clients"] if c["status"] == "reported"]) == 2


def _set_closing(settings, job_id: int, closing_at) -> None:
    """The job's round "closing" since ``closing_at``, its deadline past (once reopened, the sweep closes it)."""
    from datetime import timedelta

    from sqlalchemy import update

    from server.db import make_engine
    from server.tables import Round, utcnow

    engine = make_engine(settings.db_url)
    past = utcnow() - timedelta(seconds=1)
    try:
        with engine.begin() as conn:
            conn.execute(
                update(Round)
                .where(Round.job_id == job_id)
                .values(status="closing", closing_at=closing_at, deadline_at=past)
            )
    finally:
        engine.dispose()


def test_a_close_left_by_a_dead_api_process_is_reopened_by_the_sweep_once_stale(
    client: TestClient, world: dict, settings
):
    """With several API processes no start-up may reopen a "closing" round (a live process may be closing it): the
    sweep reopens a close only once it is older than any close may take, and then closes the round."""
    from server.federation import stale_close_after
    from server.tables import utcnow

    join(client, world, "a", "b", "c")
    job = submit(client, world, rounds=1, clients_per_round=3, min_clients=2, round_timeout_s=600)
    parts = {name: lease(client, world, name) for name in "ab"}
    for i, name in enumerate("ab"):
        assert report(client, world, name, parts[name], i)[0].status_code == 201
    client.app.state.verify_pool = InlinePool()
    _set_closing(settings, job["id"], utcnow())  # a live close, just begun
    time.sleep(1.5)  # three sweeps (every 0.5 s)
    assert rounds(client, job["id"])[0]["status"] == "closing"  # left alone
    _set_closing(settings, job["id"], utcnow() - stale_close_after(settings) - (stale_close_after(settings) / 10))
    done = wait_for(lambda: _finished(client, job["id"]), 60, "the stale close to be reopened and the round closed")
    assert done["status"] == "succeeded", done["error"]
    assert rounds(client, job["id"])[0]["status"] == "closed"


def test_a_close_given_up_on_cannot_publish_or_fail_the_round(client: TestClient, world: dict):
    """A closer whose attempt was reopened as stale and taken by another: its finish raises CloseTakenOver (the
    caller rolls back what it would have published), its abort leaves the job alone; the new attempt finishes."""
    from datetime import timedelta

    from server import registry
    from server.state import closes
    from server.tables import Round

    join(client, world, "a", "b")
    job = submit(client, world, rounds=1, clients_per_round=2, round_timeout_s=600)
    lease(client, world, "a")
    with client.app.state.sessionmaker() as session:
        round_ = session.scalars(select(Round).where(Round.job_id == job["id"])).one()
        old = closes.begin_close(session, round_.id)
        assert old is not None and closes.begin_close(session, round_.id) is None  # one closer at a time
        assert closes.reopen_stale_closes(session, timedelta(0)) == 1
        new = closes.begin_close(session, round_.id)
        assert new is not None and new != old
        files = registry.StoredFiles(round_.b_sha256, round_.b_sha256, "0" * 64, "0" * 64, 0)
        with pytest.raises(closes.CloseTakenOver):
            closes.finish_close(session, round_, old, files, {"mean_loss": None, "aggregate_s": 0.0}, [])
        published = client.get("/v1/adapters", headers=world["users"]["a"]).json()["count"]
        assert published == 0, "the old closer published nothing"
        closes.abort_close(session, round_, old, "the old closer's error")
        assert rounds(client, job["id"])[0]["status"] == "closing"
        assert client.get(f"/v1/jobs/{job['id']}", headers=ADMIN).json()["status"] == "running"
        closes.retry_close(session, round_, new)  # the new attempt may give the round back
    assert rounds(client, job["id"])[0]["status"] == "open"


def test_a_round_log_that_is_not_the_round_part_is_refused(client: TestClient, world: dict):
    join(client, world, "a")
    submit(client, world, rounds=1, clients_per_round=1, round_timeout_s=60, max_abs_g=0.001)
    mine = lease(client, world, "a")
    r, _ = report(client, world, "a", mine, 0)  # fake losses give |g| far above 0.001
    assert r.status_code == 422 and "bound" in r.text
    wrong_seed = {**mine, "spec": {**mine["spec"], "seed": mine["spec"]["seed"] + 1}}
    r, _ = report(client, world, "a", wrong_seed, 0)
    assert r.status_code == 422 and "seed" in r.text
    other = enroll_device(client, world["users"]["b"], "b-2")
    url = f"/v1/work/part-{mine['round']['client_id']}/heartbeat"
    assert client.post(url, json={"step": 1}, headers=other["headers"]).status_code == 404
    assert client.post(url, json={"step": 1}, headers=world["devices"]["a"]["headers"]).json()["cancelled"] is False


def test_a_round_part_heartbeat_records_its_device_as_seen_once_an_interval(client: TestClient, world: dict):
    from tests.server.test_work import beats_write_the_device_once_an_interval

    join(client, world, "a")
    submit(client, world, rounds=1, clients_per_round=1, round_timeout_s=600)
    mine = lease(client, world, "a")
    path = f"/v1/work/part-{mine['round']['client_id']}/heartbeat"
    beats_write_the_device_once_an_interval(client, path, world["devices"]["a"]["headers"])


def test_a_personal_job_with_upload_log_stores_the_replay(client: TestClient, world: dict, settings):
    from tests.server.factories import b_flat_bytes, submit_job

    a = world["users"]["a"]
    job = submit_job(client, a, upload="log")
    got = client.post("/v1/leases", json={}, headers=world["devices"]["a"]["headers"]).json()
    b, log = fake_training(got["spec"], got["manifest"]["lora_size"])
    files = {"log": ("log.jsonl", log.encode()), "metrics": ("metrics.json", b"{}")}
    with_b = {**files, "b_flat": ("b.safetensors", b_flat_bytes(b))}
    headers = world["devices"]["a"]["headers"]
    r = client.post(f"/v1/work/job-{job['id']}/result", files=with_b, headers=headers)
    assert r.status_code == 422 and "log alone" in r.text
    r = client.post(f"/v1/work/job-{job['id']}/result", files=files, headers=headers)
    assert r.status_code == 201, r.text
    adapter = client.get(f"/v1/adapters/{r.json()['adapter_id']}", headers=a).json()
    stored = load((settings.data_dir / "adapters" / f"{adapter['b_sha256']}.safetensors").read_bytes())["b_flat"]
    assert np.array_equal(stored.view(np.int32), b.view(np.int32))
    assert client.post(f"/v1/work/job-{job['id']}/result", files=files, headers=headers).status_code == 200  # a repeat


def test_a_revoked_device_frees_its_slot_in_the_round(client: TestClient, world: dict):
    join(client, world, "a", "b")
    submit(client, world, rounds=1, clients_per_round=1, min_clients=1, round_timeout_s=600)
    part = lease(client, world, "a")
    assert part is not None and lease(client, world, "b") is None  # K = 1: the slot is a's
    r = client.post(f"/v1/devices/{world['devices']['a']['id']}/revoke", headers=world["users"]["a"])
    assert r.status_code == 200, r.text
    taken = lease(client, world, "b")
    assert taken is not None and taken["round"]["index"] == 0  # a's part expired with its device
    reported, _ = report(client, world, "b", taken, 1)
    assert reported.status_code == 201, reported.text
    r = client.get(part["init"]["url"], headers=world["devices"]["a"]["headers"])
    assert r.status_code == 401 and "revoked" in r.json()["detail"]


def test_a_round_parts_files_are_granted_to_its_device_while_it_holds_the_part(client: TestClient, world: dict):
    join(client, world, "a", "b")
    submit(client, world, rounds=1, clients_per_round=1, min_clients=1, round_timeout_s=600)
    part = lease(client, world, "a")
    urls = [part[entry]["url"] for entry in ("program", "weights", "tokenizer", "init")]
    assert all(
        url == f"/v1/blobs/{part[entry]['sha256']}"
        for url, entry in zip(urls, ("program", "weights", "tokenizer", "init"))
    )
    for url in urls:
        assert client.get(url, headers=world["devices"]["a"]["headers"]).status_code == 200
        assert client.get(url, headers=world["devices"]["b"]["headers"]).status_code == 404  # a member, not its part
    r = client.post(
        f"/v1/work/part-{part['round']['client_id']}/fail",
        json={"error": "gave up"},
        headers=world["devices"]["a"]["headers"],
    )
    assert r.status_code == 204, r.text
    for url in urls:  # the part is over: nothing is granted any more
        assert client.get(url, headers=world["devices"]["a"]["headers"]).status_code == 404


def test_the_dashboard_shows_a_federated_jobs_rounds_and_the_cohorts_adapter_lineage(client: TestClient, world: dict):
    """The admin's job page lists each round's participants and the parts not counted; a member's adapters page
    shows the cohort's versions as one lineage (round r+1's adapter started from round r's)."""
    from tests.server.test_dashboard import browser, sign_in

    join(client, world, "a", "b", "c")
    job = submit(client, world, rounds=2, clients_per_round=2, round_timeout_s=600)
    for index in range(2):
        leases = {name: lease(client, world, name) for name in ("ab" if index == 0 else "bc")}
        for i, name in enumerate(leases):
            assert report(client, world, name, leases[name], 10 * index + i)[0].status_code == 201
        # the last report closes the round, or the round sweeper did, a moment later
        wait_for(lambda i=index: rounds(client, job["id"])[i]["status"] == "closed", 60, f"round {index} to close")
    assert client.get(f"/v1/jobs/{job['id']}", headers=ADMIN).json()["status"] == "succeeded"

    client = browser(client)
    sign_in(client, ADMIN["Authorization"].split()[1])
    page = client.get(f"/ui/jobs/{job['id']}").text
    table = page[page.index('<table id="rounds">') :]
    assert table.count("2 reported") == 2 and table.count('class="status closed"') == 2
    assert 'data-series="mean loss" data-points="2"' in page
    client.post("/ui/logout", data={"csrf_token": re.search(r'name="csrf_token" value="([^"]+)"', page).group(1)})

    sign_in(client, world["users"]["c"]["Authorization"].split()[1])
    adapters = client.get("/ui/adapters").text
    edges = re.findall(r'data-from="(\d+)" data-to="(\d+)"', adapters)
    assert "cohort" in adapters and len(edges) == 1 and int(edges[0][1]) > int(edges[0][0])
    version = client.get(f"/ui/adapters/{edges[0][1]}")
    assert version.status_code == 200 and "round 1" in version.text
    archive = client.get(f"/ui/adapters/{edges[0][1]}/download")
    assert archive.status_code == 200 and archive.content[:2] == b"PK"


def test_a_private_federated_job_runs_private_parts_and_states_each_members_guarantee(
    client: TestClient, world: dict, settings
):
    """Local DP in rounds: every part is a private run (the program takes the clip and noise, the log carries g
    alone, a log with losses is refused), calibrated so that each member's data is (epsilon, delta)-DP over every
    part it could train (rounds x local steps); the cohort's adapters state that guarantee. Each part a member's
    device takes is an entry of the member's privacy ledger, and a part over the member's budget is not leased."""
    from shared.privacy import noise_multiplier

    join(client, world, "a", "b", "c")
    assert client.put("/v1/privacy", json={"epsilon": 1.0}, headers=world["users"]["c"]).status_code == 200
    job = submit(client, world, rounds=2, clients_per_round=2, privacy={"epsilon": 8.0, "min_examples": 64})
    sigma = noise_multiplier(8.0, 1e-5, HYPER["steps"] * 2, HYPER["batch_size"], 64)
    for index in range(2):
        assert lease(client, world, "c") is None  # one part would spend more than c's budget of 1
        leases = {name: lease(client, world, name) for name in "ab"}
        for x in leases.values():
            assert x["spec"]["privacy"]["noise_multiplier"] == sigma and x["manifest"]["config"]["private"]
        if index == 0:  # a part whose log carries its losses says more than g: refused
            spec, d = leases["a"]["spec"], leases["a"]["manifest"]["lora_size"]
            _, open_log = fake_training({**spec, "privacy": None}, d, init_b(client, world, "a", leases["a"]))
            files = {"log": ("log.jsonl", io.BytesIO(open_log.encode())), "metrics": ("m.json", io.BytesIO(b"{}"))}
            url = f"/v1/work/part-{leases['a']['round']['client_id']}/result"
            r = client.post(url, files=files, headers=world["devices"]["a"]["headers"])
            assert r.status_code == 422 and "losses" in r.text, r.text
        for i, name in enumerate("ab"):
            assert report(client, world, name, leases[name], 10 * index + i)[0].status_code == 201
        wait_for(lambda i=index: rounds(client, job["id"])[i]["status"] == "closed", 30, f"round {index} to close")
    listed = rounds(client, job["id"])
    assert all(r["mean_loss"] is None for r in listed)  # private parts report no loss
    ledger = client.get("/v1/privacy", headers=world["users"]["a"]).json()
    assert [(e["job_id"], e["round"], e["status"]) for e in ledger["jobs"]] == [(job["id"], 0, "reported")] + [
        (job["id"], 1, "reported")
    ]
    assert 0 < ledger["spent"] <= 8.0  # the two parts compose to at most the job's epsilon
    assert client.get("/v1/privacy", headers=world["users"]["c"]).json()["jobs"] == []
    adapter = client.get(f"/v1/adapters/{listed[-1]['adapter_id']}", headers=world["users"]["a"]).json()
    assert adapter["privacy"] == {
        "epsilon": 8.0,
        "delta": 1e-5,
        "noise_multiplier": sigma,
        "clip": adapter["privacy"]["clip"],
        "steps": HYPER["steps"] * 2,
        "sampling_rate": HYPER["batch_size"] / 64,
    }


def _versions_are(client: TestClient, job_id: int, *statuses: str) -> list[dict] | None:
    """The job's rounds when their statuses are ``statuses``, else None."""
    listed = rounds(client, job_id)
    return listed if [r["status"] for r in listed] == list(statuses) else None


def test_buffered_versions_count_a_straggler_later_weighted_by_its_staleness(client: TestClient, world: dict, settings):
    """Buffered: a version closes at every K arrivals from any of the last max_staleness + 1 versions. c leases
    version 0 beside a and b; a and b close it; c's part stays leased (one version old is within the bound), is
    replayed from the B it leased (B_0) and closes version 1 with d's fresh part, weighted 1/sqrt(2) against d's 1.
    Every version is the offline recomputation of its stored record, bit for bit."""
    from server.tables import Adapter
    from shared.aggregate import next_global_b

    join(client, world, "a", "b", "c", "d")
    job = submit(client, world, rounds=2, clients_per_round=2, mode="buffered", max_staleness=1, global_lr=0.5)
    leases = {name: lease(client, world, name) for name in "abc"}  # in flight: 3 of 2K = 4
    assert {leases[name]["round"]["index"] for name in "abc"} == {0}
    for seed, name in enumerate("ab"):
        assert report(client, world, name, leases[name], seed)[0].status_code == 201
    # the K-th report closes the version, or the round sweeper did, a moment later
    listed = wait_for(lambda: _versions_are(client, job["id"], "closed", "open"), 60, "version 0 to close")
    assert [c["status"] for c in listed[0]["clients"]] == ["reported", "reported", "leased"]  # c: not expired
    leases["d"] = lease(client, world, "d")
    assert leases["d"]["round"]["index"] == 1
    assert report(client, world, "c", leases["c"], 7)[0].status_code == 201  # one version old
    assert rounds(client, job["id"])[1]["status"] == "open"  # one arrival of K = 2
    assert report(client, world, "d", leases["d"], 8)[0].status_code == 201
    done = wait_for(lambda: _finished(client, job["id"]), 60, "version 1 to close")
    assert done["status"] == "succeeded", done["error"]
    listed = rounds(client, job["id"])
    counted = {c["device_id"]: c["counted_in_round_id"] for r in listed for c in r["clients"]}
    devices = {name: world["devices"][name]["id"] for name in "abcd"}
    assert counted == {devices["a"]: listed[0]["id"], devices["b"]: listed[0]["id"]} | {
        devices["c"]: listed[1]["id"],
        devices["d"]: listed[1]["id"],
    }
    store = settings.data_dir
    for index, round_ in enumerate(listed):
        adapter = client.get(f"/v1/adapters/{round_['adapter_id']}", headers=world["users"]["a"]).json()
        with client.app.state.sessionmaker() as session:
            record_sha = session.get_one(Adapter, adapter["id"]).log_sha256  # the round's record
        record = json.loads((store / "rounds" / f"{record_sha}.json").read_bytes())
        assert record["mode"] == "buffered"
        staleness = [c["staleness"] for c in record["clients"]]
        assert staleness == ([0, 0] if index == 0 else [1, 0])
        starts = [_stored_b(store, c["b_start_sha256"]) for c in record["clients"]]
        client_bs = [_stored_b(store, c["b_sha256"]) for c in record["clients"]]
        b_r = _stored_b(store, record["b_r_sha256"])
        expected, _ = next_global_b(b_r, client_bs, "fedavg", 0.1, 0.5, starts=starts, staleness=staleness)
        stored = _stored_b(store, adapter["b_sha256"])
        assert np.array_equal(stored.view(np.int32), expected.view(np.int32))
    # the admin's job page: what each version counted, with its staleness, and the parts by staleness
    from tests.server.test_dashboard import browser, sign_in

    web = browser(client)
    sign_in(web, ADMIN["Authorization"].split()[1])
    page = web.get(f"/ui/jobs/{job['id']}").text
    assert re.findall(r'<td class="counted">([^<]*)</td>', page) == ["2 (0, 0)", "2 (1, 0)"]
    assert 'data-series="parts" data-points="2"' in page
    # the straggler's delta is from the version it leased, and its weight is not 1
    weighted, _ = next_global_b(b_r, client_bs, "fedavg", 0.1, 0.5, starts=starts, staleness=[1, 0])
    unweighted, _ = next_global_b(b_r, client_bs, "fedavg", 0.1, 0.5, starts=starts)
    assert not np.array_equal(weighted, unweighted)


def test_a_buffered_part_older_than_the_bound_is_refused_with_the_reason(client: TestClient, world: dict):
    join(client, world, "a", "b", "c")
    job = submit(client, world, rounds=3, clients_per_round=2, mode="buffered", max_staleness=0)
    leases = {name: lease(client, world, name) for name in "abc"}
    spec, d = leases["c"]["spec"], leases["c"]["manifest"]["lora_size"]
    _, log = fake_training(spec, d, init_b(client, world, "c", leases["c"]), seed=9)  # c trains from B_0
    for seed, name in enumerate("ab"):
        assert report(client, world, name, leases[name], seed)[0].status_code == 201
    wait_for(lambda: _versions_are(client, job["id"], "closed", "open"), 60, "version 0 to close")
    files = {"log": ("log.jsonl", io.BytesIO(log.encode())), "metrics": ("metrics.json", io.BytesIO(b"{}"))}
    url = f"/v1/work/part-{leases['c']['round']['client_id']}/result"
    stale = client.post(url, files=files, headers=world["devices"]["c"]["headers"])
    assert stale.status_code == 409 and "more than 0 versions old" in stale.text
    assert rounds(client, job["id"])[0]["clients"][2]["status"] == "expired"


def test_buffered_and_sync_aggregate_alike_when_no_part_is_stale():
    """With every staleness 0 (weight 1) and every part from B_r, the buffered rule is the synchronous one, bit for
    bit."""
    from shared.aggregate import next_global_b, staleness_weight

    rng = np.random.default_rng(0)
    b_r = rng.standard_normal(64).astype(np.float32)
    client_bs = [b_r + rng.standard_normal(64).astype(np.float32) for _ in range(3)]
    for method in ("fedavg", "trimmed-mean", "median"):
        sync = next_global_b(b_r, client_bs, method, 0.34, 0.7, 0.9, None)
        buffered = next_global_b(b_r, client_bs, method, 0.34, 0.7, 0.9, None, [b_r] * 3, [0, 0, 0])
        assert all(np.array_equal(x.view(np.int32), y.view(np.int32)) for x, y in zip(sync, buffered, strict=True))
    assert staleness_weight(0) == 1 and staleness_weight(3) == np.float32(0.5)


def test_a_resent_report_is_told_it_was_received_before(client: TestClient, world: dict):
    """A device that lost the answer to its report and sends it again is told the truth: its report is in, not that
    the round closed or its lease ran out (the round is still open, waiting for the other part)."""
    join(client, world, "a", "b")
    job = submit(client, world, rounds=1, clients_per_round=2, round_timeout_s=600)
    parts = {name: lease(client, world, name) for name in "ab"}
    _, log = fake_training(
        parts["a"]["spec"], parts["a"]["manifest"]["lora_size"], init_b(client, world, "a", parts["a"])
    )
    url, headers = f"/v1/work/part-{parts['a']['round']['client_id']}/result", world["devices"]["a"]["headers"]

    def send():
        files = {"log": ("log.jsonl", io.BytesIO(log.encode())), "metrics": ("metrics.json", io.BytesIO(b"{}"))}
        return client.post(url, files=files, headers=headers)

    assert send().status_code == 201
    again = send()
    assert again.status_code == 409 and "received before" in again.json()["detail"], again.text
    assert "late" not in again.json()["detail"] and rounds(client, job["id"])[0]["status"] == "open"
    assert report(client, world, "b", parts["b"], 1)[0].status_code == 201
    wait_for(lambda: rounds(client, job["id"])[0]["status"] == "closed", 30, "the round to close")
    counted = send()
    assert counted.status_code == 409 and "received before, and counted" in counted.json()["detail"], counted.text


class _HeldPackaging(InlinePool):
    """A verify pool whose packaging tasks wait until ``release`` is set (every other task runs at once)."""

    def __init__(self) -> None:
        self.release, self.started = threading.Event(), threading.Event()

    def run(self, fn, *args, timeout=None, key=None, owner=None):
        from server.verify import package_adapter

        if fn is package_adapter:
            self.started.set()
            assert self.release.wait(60), "the test never released the packaging"
        return fn(*args)


def test_the_report_that_fills_a_round_is_answered_before_the_close(client: TestClient, world: dict):
    """The K-th report is answered as soon as it is recorded: the round sweeper closes the round (aggregation,
    the adapter's packaging), not the device's request."""
    join(client, world, "a", "b")
    job = submit(client, world, rounds=1, clients_per_round=2, round_timeout_s=600)
    parts = {name: lease(client, world, name) for name in "ab"}
    pool = client.app.state.verify_pool = _HeldPackaging()
    try:
        assert report(client, world, "a", parts["a"], 0)[0].status_code == 201
        answers: list = []
        last = threading.Thread(target=lambda: answers.append(report(client, world, "b", parts["b"], 1)[0]))
        last.start()
        last.join(timeout=30)
        assert not last.is_alive() and answers[0].status_code == 201, "the K-th report waited for the close"
        assert pool.started.wait(30), "nobody began to close the full round"
        assert rounds(client, job["id"])[0]["status"] == "closing"
    finally:
        pool.release.set()
    done = wait_for(lambda: _finished(client, job["id"]), 60, "the round to close")
    assert done["status"] == "succeeded" and rounds(client, job["id"])[0]["status"] == "closed"


def test_a_revoked_device_is_told_so_on_another_users_part(client: TestClient, world: dict):
    """A revoked device's token answers 401 (revoked) on any part, not 404 on a part of another user: the agent
    stops on the 401, where a 404 would only make it drop that part."""
    join(client, world, "a")
    submit(client, world, rounds=1, clients_per_round=1, round_timeout_s=600)
    part = lease(client, world, "a")
    assert client.post(f"/v1/devices/{world['devices']['n']['id']}/revoke", headers=world["users"]["n"]).status_code
    path = f"/v1/work/part-{part['round']['client_id']}/heartbeat"
    answer = client.post(path, json={"step": 1}, headers=world["devices"]["n"]["headers"])
    assert answer.status_code == 401 and "revoked" in answer.json()["detail"], answer.text
    unknown = client.post("/v1/work/part-999999/heartbeat", json={"step": 1}, headers=world["devices"]["n"]["headers"])
    assert unknown.status_code == 401
