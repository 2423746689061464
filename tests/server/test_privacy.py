"""Private jobs on the server: the noise fixed at submit, the ledgers of users and cohorts (budget, refusal, races)
on SQLite and PostgreSQL, the lease filter, and the checks of a private log (no losses; |g| within the clip plus the
noise's tail)."""

from __future__ import annotations

import hashlib
import threading
import time

import httpx
import numpy as np
import pytest

from server.app import create_app
from server.verify import private_g_bound
from shared import privacy
from tests.server.factories import (
    ADMIN_TOKEN,
    FakeCompileQueue,
    InlinePool,
    b_flat_bytes,
    bearer,
    create_user,
    enroll_device,
    make_fake_model,
    register_model,
    submit_job,
    upload,
)
from tests.server.live import app_in_thread

# One private configuration throughout: its noise multiplier is calibrated once per test process (about 5 s).
PRIVATE = {"epsilon": 3.0, "min_examples": 100}
SPEC = {"q": 2, "batch_size": 4, "steps": 3}
BUDGET = 3.2  # room for one such job: two compose to epsilon 3.46 (RDP composition is sublinear)


def sigma() -> float:
    return privacy.noise_multiplier(3.0, 1e-5, SPEC["steps"], SPEC["batch_size"], 100)


@pytest.fixture
def user(client, tmp_path):
    register_model(client, make_fake_model(tmp_path / "model"))
    return create_user(client)


def test_a_private_job_gets_its_noise_and_spends_from_the_ledger(client, user):
    job = submit_job(client, user, privacy=PRIVATE)
    assert job["spec"]["privacy"]["noise_multiplier"] == sigma()
    ledger = client.get("/v1/privacy", headers=user).json()
    assert ledger["budget"] == {"epsilon": 10.0, "delta": 1e-5}  # the server's default budget
    assert [e["job_id"] for e in ledger["jobs"]] == [job["id"]] and ledger["jobs"][0]["spends"]
    assert 2.99 <= ledger["spent"] <= 3.0  # the calibration never overshoots its target
    assert ledger["remaining"] == pytest.approx(10.0 - ledger["spent"])
    submit_job(client, user)  # a job without privacy leaves the ledger as it is
    assert client.get("/v1/privacy", headers=user).json()["spent"] == ledger["spent"]


def test_a_job_past_the_budget_is_refused_naming_what_remains(client, user):
    assert client.put("/v1/privacy", json={"epsilon": BUDGET}, headers=user).status_code == 200
    submit_job(client, user, privacy=PRIVATE)
    r = client.post("/v1/jobs", json={"model": "tiny", "task": "sst2", **SPEC, "privacy": PRIVATE}, headers=user)
    assert r.status_code == 409, r.text
    assert f"over your budget of {BUDGET:g}" in r.json()["detail"] and "remains" in r.json()["detail"]
    assert client.get("/v1/jobs", headers=user).json()["count"] == 1  # nothing stored
    spent = client.get("/v1/privacy", headers=user).json()["spent"]
    r = client.put("/v1/privacy", json={"epsilon": 1.0}, headers=user)  # below what was spent
    assert r.status_code == 409 and r.json()["detail"][0]["loc"] == ["body", "epsilon"]
    assert f"{spent:.3g}" in r.json()["detail"][0]["msg"]


def test_a_job_cancelled_before_any_lease_gives_its_budget_back(client, user):
    assert client.put("/v1/privacy", json={"epsilon": BUDGET}, headers=user).status_code == 200
    job = submit_job(client, user, privacy=PRIVATE)
    assert client.post(f"/v1/jobs/{job['id']}/cancel", headers=user).status_code == 200
    ledger = client.get("/v1/privacy", headers=user).json()
    assert ledger["spent"] == 0.0 and not ledger["jobs"][0]["spends"]
    submit_job(client, user, privacy=PRIVATE)  # fits again


@pytest.mark.parametrize(
    ("privacy_change", "other", "field"),
    [
        ({"noise_multiplier": 0.1}, {}, "privacy"),  # the server's to set
        ({"min_examples": 2}, {}, "privacy"),  # fewer than a batch
        ({"epsilon": 0}, {}, "epsilon"),
        ({"delta": 0.5}, {}, "delta"),
    ],
)
def test_bad_private_specs_answer_422_naming_the_field(client, user, privacy_change, other, field):
    body = {"model": "tiny", "task": "sst2", **SPEC, **other, "privacy": {**PRIVATE, **privacy_change}}
    r = client.post("/v1/jobs", json=body, headers=user)
    assert r.status_code == 422, r.text
    error = r.json()["detail"][0]
    assert field in error["loc"] or f"{field}:" in error["msg"]  # by place, or (a model's check) by name


def test_a_private_job_is_leased_to_any_backend_with_its_noise_multiplier(client, user):
    """The native runner (adb) takes a private step's clip and noise too, so a private job asking for adb is taken."""
    adb = enroll_device(client, user, "adb-phone", backend="adb")
    job = submit_job(client, user, privacy=PRIVATE, device_backend="adb")
    lease = client.post("/v1/leases", headers=adb["headers"]).json()
    assert lease["job_id"] == job["id"] and lease["spec"]["privacy"]["noise_multiplier"] == sigma()
    assert lease["manifest"]["config"]["private"]  # the job's program takes the clip and the noise


def _private_log(spec: dict, g_scale: float, losses: bool = False) -> tuple[np.ndarray, str]:
    import json

    import torch

    from server.verify import expected_lr
    from shared.noise import step_seed
    from shared.replay import replay
    from shared.train_log import log_line, log_record

    rng = np.random.default_rng(0)
    records = []
    for step in range(spec["steps"]):
        g = (rng.standard_normal(spec["q"]) * g_scale).astype(np.float32)
        logged = np.ones(2 * spec["q"], np.float32) if losses else None
        lr = expected_lr(spec, step)
        records.append(
            json.loads(log_line(log_record(step, step_seed(spec["seed"], step), lr, spec["eps"], g, logged)))
        )
    return replay(torch.zeros(int(spec["d"])), records).numpy(), "".join(map(log_line, records))


def test_a_private_log_is_checked_without_losses(client, user):
    phone = enroll_device(client, user)
    job = submit_job(client, user, privacy=PRIVATE)
    lease = client.post("/v1/leases", headers=phone["headers"]).json()
    spec = lease["spec"] | {"d": lease["manifest"]["lora_size"]}
    bound = private_g_bound(lease["spec"])
    assert bound > PRIVATE.get("clip", 1.0)
    _, with_losses = _private_log(spec, 0.1, losses=True)
    r = upload(client, phone, job["id"], b_flat_bytes(np.zeros(spec["d"], np.float32)), with_losses)
    assert r.status_code == 422 and "holds no losses" in r.text
    b, too_far = _private_log(spec, 10 * bound)
    r = upload(client, phone, job["id"], b_flat_bytes(b), too_far)
    assert r.status_code == 422 and "above the bound" in r.text
    b, honest = _private_log(spec, 0.1)
    r = upload(client, phone, job["id"], b_flat_bytes(b), honest)
    assert r.status_code == 201, r.text


def test_a_private_jobs_log_and_metrics_keep_nothing_off_the_allow_list(client, user):
    """A private job's contract on every field: a log line with any key but step, seed, lr, eps and g is refused (the
    log is stored as sent); of its metrics only the job's own parameters are stored (``PRIVATE_METRICS``): free
    text, timings and counts of the data are dropped."""
    import json

    from shared.schemas import PRIVATE_METRICS

    phone = enroll_device(client, user)
    job = submit_job(client, user, privacy=PRIVATE)
    lease = client.post("/v1/leases", headers=phone["headers"]).json()
    spec = lease["spec"] | {"d": lease["manifest"]["lora_size"]}
    b, honest = _private_log(spec, 0.1)
    lines = [json.loads(line) for line in honest.splitlines()]
    leaky = "".join(json.dumps({**line, "per_example_loss": [0.7, 1.3]}) + "\n" for line in lines)
    r = upload(client, phone, job["id"], b_flat_bytes(b), leaky)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "log"], r.text
    assert "nothing else" in r.text
    sent = {
        "method": "mobizo", "targets": ["q_proj", "v_proj"], "backend": "executorch", "task": "sst2",
        "optimizer": "sgd", "program_sha256": "0" * 64, "step_time_s": 0.125, "train_time_s": 0.375,
        "peak_rss_mb": 812.0, "n_train": 117, "losses": None, "eval": [],
        "q": spec["q"], "batch_size": spec["batch_size"], "steps": spec["steps"], "seed": spec["seed"],
        "lr": spec["lr"], "eps": spec["eps"], "rank": spec["rank"], "job_id": job["id"],
    }  # fmt: skip
    r = upload(client, phone, job["id"], b_flat_bytes(b), honest, json.dumps(sent).encode())
    assert r.status_code == 201, r.text
    stored = client.get(f"/v1/adapters/{r.json()['adapter_id']}", headers=user).json()["metrics"]
    kept = {"q", "batch_size", "steps", "seed", "lr", "eps", "rank", "job_id", "losses", "eval"}
    assert set(stored) - {"server", "log_sha256"} == kept and kept <= PRIVATE_METRICS
    assert stored["log_sha256"] == hashlib.sha256(honest.encode()).hexdigest()  # the server's, of the log it kept
    assert (stored["steps"], stored["losses"], stored["eval"]) == (spec["steps"], None, [])


def _race(call) -> list:
    """``call()`` from two threads released together → their results."""
    start, results = threading.Barrier(2), []

    def run() -> None:
        start.wait()
        results.append(call())

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_two_racing_private_submits_cannot_both_spend_the_rest(settings, tmp_path):
    """Two threads of one user submit at once over real sockets, with room in the budget for one job: one is taken
    and one refused, on both databases (the ledger version serializes them)."""
    app = create_app(settings, queue_factory=FakeCompileQueue().bind)
    body = {"model": "tiny", "task": "sst2", **SPEC, "privacy": PRIVATE}
    sigma()  # calibrated before the race (the server process shares this cache)
    with app_in_thread(app) as url:
        admin = httpx.Client(base_url=url, headers=bearer(ADMIN_TOKEN), timeout=60)
        admin.post("/v1/models", json={"name": "tiny", "path": str(make_fake_model(tmp_path / "m"))})
        for round_ in range(3):
            key = admin.post("/v1/users", json={"name": f"racer{round_}"}).json()["api_key"]
            http = httpx.Client(base_url=url, headers=bearer(key), timeout=60)
            assert http.put("/v1/privacy", json={"epsilon": BUDGET}).status_code == 200
            codes = _race(lambda: http.post("/v1/jobs", json=body).status_code)  # noqa: B023
            assert sorted(codes) == [202, 409], codes
            assert len(http.get("/v1/privacy").json()["jobs"]) == 1


# A cohort's ledger: its private federated jobs (one round of SPEC's steps each: the same noise as a private job).
ADMIN = bearer(ADMIN_TOKEN)
FEDERATED = {**SPEC, "rank": 2, "rounds": 1, "clients_per_round": 1, "privacy": PRIVATE}


def _cohort(http, name: str = "keyboard") -> int:
    r = http.post("/v1/cohorts", json={"name": name, "model": "tiny", "task": "sst2"}, headers=ADMIN)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def test_a_cohorts_private_jobs_spend_from_its_own_budget(client, user):
    cohort = _cohort(client)
    ledger = f"/v1/cohorts/{cohort}/privacy"
    assert client.put(ledger, json={"epsilon": BUDGET}, headers=user).status_code == 403  # the admin's to set
    assert client.put(ledger, json={"epsilon": BUDGET}, headers=ADMIN).status_code == 200
    job = client.post(f"/v1/cohorts/{cohort}/jobs", json=FEDERATED, headers=ADMIN).json()
    assert job["spec"]["privacy"]["noise_multiplier"] == sigma()
    r = client.post(f"/v1/cohorts/{cohort}/jobs", json=FEDERATED, headers=ADMIN)
    assert r.status_code == 409, r.text
    assert f"over cohort keyboard's budget of {BUDGET:g}" in r.json()["detail"] and "remains" in r.json()["detail"]
    shown = client.get(ledger, headers=user).json()  # members and would-be members may read it
    assert [e["job_id"] for e in shown["jobs"]] == [job["id"]] and 2.99 <= shown["spent"] <= 3.0
    assert shown["budget"] == {"epsilon": BUDGET, "delta": 1e-5}
    open_job = {k: v for k, v in FEDERATED.items() if k != "privacy"}
    assert client.post(f"/v1/cohorts/{cohort}/jobs", json=open_job, headers=ADMIN).status_code == 202
    r = client.put(ledger, json={"epsilon": 1.0}, headers=ADMIN)  # below what its jobs spent
    assert r.status_code == 409 and r.json()["detail"][0]["loc"] == ["body", "epsilon"]
    assert client.get("/v1/privacy", headers=user).json()["spent"] == 0.0  # no member has taken a part yet
    other = _cohort(client, "camera")  # another cohort's ledger is its own
    assert client.get(f"/v1/cohorts/{other}/privacy", headers=ADMIN).json()["jobs"] == []
    assert client.get("/v1/cohorts/999/privacy", headers=ADMIN).status_code == 404


def test_two_racing_private_federated_submits_cannot_both_spend_the_cohorts_rest(settings, tmp_path):
    """The cohort's ledger version serializes two admin submits racing over real sockets, on both databases."""
    app = create_app(settings, queue_factory=FakeCompileQueue().bind)
    sigma()
    with app_in_thread(app) as url:
        admin = httpx.Client(base_url=url, headers=ADMIN, timeout=60)
        admin.post("/v1/models", json={"name": "tiny", "path": str(make_fake_model(tmp_path / "m"))})
        for round_ in range(3):
            cohort = _cohort(admin, f"cohort{round_}")
            assert admin.put(f"/v1/cohorts/{cohort}/privacy", json={"epsilon": BUDGET}).status_code == 200
            codes = _race(lambda: admin.post(f"/v1/cohorts/{cohort}/jobs", json=FEDERATED).status_code)  # noqa: B023
            assert sorted(codes) == [202, 409], codes
            assert len(admin.get(f"/v1/cohorts/{cohort}/privacy").json()["jobs"]) == 1


# A private submit's cost to the API process: the ledger first, the accountant's arithmetic in a worker process.


def _calibrations(monkeypatch: pytest.MonkeyPatch, hold: threading.Event | None = None) -> list[float]:
    """The target epsilon of every calibration this process runs from now on (dp-accounting's search over sigma),
    each held until ``hold`` is set, if given. The process's remembered calibrations start empty, so numbers an
    earlier test of this process calibrated (the same test on the other database) are calibrated again."""
    from dp_accounting import mechanism_calibration

    from shared import accounting
    from shared.lru import LRUCache

    monkeypatch.setattr(accounting, "_SIGMAS", LRUCache(4096))
    calls, real = [], mechanism_calibration.calibrate_dp_mechanism

    def recorded(*args, **kwargs):
        calls.append(args[2])
        if hold is not None:
            assert hold.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(mechanism_calibration, "calibrate_dp_mechanism", recorded)
    return calls


def test_a_spent_ledger_refuses_a_private_job_before_calibrating_it(client, user, monkeypatch):
    """With nothing left in the budget, any private job passes it: refused (409) without its calibration (seconds of
    the server's CPU), however new its numbers."""
    submit_job(client, user, privacy=PRIVATE)
    spent = client.get("/v1/privacy", headers=user).json()["spent"]
    assert client.put("/v1/privacy", json={"epsilon": spent}, headers=user).status_code == 200  # all of it spent
    calibrations = _calibrations(monkeypatch)
    fresh = {"epsilon": 2.5, "min_examples": 123}  # calibrated nowhere in this process
    r = client.post("/v1/jobs", json={"model": "tiny", "task": "sst2", **SPEC, "privacy": fresh}, headers=user)
    assert r.status_code == 409 and "nothing remains" in r.json()["detail"], r.text
    assert calibrations == []
    assert client.get("/v1/jobs", headers=user).json()["count"] == 1


def test_one_users_private_submits_at_once_are_bounded(settings, tmp_path, monkeypatch):
    """Two private submits of one user calibrating: a third answers 429 at once (Retry-After, the reason), while
    another user's plain submit goes through; once answered, the same numbers again calibrate nothing."""
    hold = threading.Event()
    calibrations = _calibrations(monkeypatch, hold)
    app = create_app(settings, queue_factory=FakeCompileQueue().bind)
    bodies = [
        {"model": "tiny", "task": "sst2", **SPEC, "privacy": {"epsilon": 1.1 + i / 10, "min_examples": 97}}
        for i in range(3)
    ]
    with app_in_thread(app) as url:
        app.state.accountant.pool = InlinePool()  # calibrated in this process, where they are held
        admin = httpx.Client(base_url=url, headers=bearer(ADMIN_TOKEN), timeout=60)
        admin.post("/v1/models", json={"name": "tiny", "path": str(make_fake_model(tmp_path / "m"))})
        users = [admin.post("/v1/users", json={"name": n}).json()["api_key"] for n in ("alice", "bob")]
        alice, bob = (httpx.Client(base_url=url, headers=bearer(key), timeout=120) for key in users)
        answers: dict[int, int] = {}

        def submit(i: int) -> None:
            answers[i] = alice.post("/v1/jobs", json=bodies[i]).status_code

        threads = [threading.Thread(target=submit, args=(i,)) for i in range(2)]
        try:
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + 30
            while len(calibrations) < 2:
                assert time.monotonic() < deadline, "the two submits did not reach their calibration"
                time.sleep(0.01)
            third = alice.post("/v1/jobs", json=bodies[2], timeout=10)  # at once: not after a calibration
            assert third.status_code == 429 and int(third.headers["retry-after"]) >= 1, third.text
            assert "private submits in progress" in third.json()["detail"]
            assert bob.post("/v1/jobs", json={k: v for k, v in bodies[0].items() if k != "privacy"}).status_code == 202
        finally:
            hold.set()
            for thread in threads:
                thread.join()
        assert answers == {0: 202, 1: 202} and len(calibrations) == 2
        assert alice.post("/v1/jobs", json=bodies[0]).status_code == 202  # remembered by its numbers
        assert len(calibrations) == 2


def test_the_privacy_arithmetic_runs_in_a_worker_process(settings, tmp_path, monkeypatch):
    """A private submit's calibration and its run's RDP curve are computed in the accountant's worker process: with
    dp-accounting's calibration and composition refused in the API's process, the submit is taken with the sigma
    that meets its target, and the ledger reads what that job spends."""
    from dp_accounting import mechanism_calibration
    from dp_accounting.rdp import RdpAccountant

    from shared import accounting

    def refused(*args, **kwargs):
        raise AssertionError("the accountant ran in the API process")

    monkeypatch.setattr(mechanism_calibration, "calibrate_dp_mechanism", refused)
    monkeypatch.setattr(RdpAccountant, "compose", refused)
    app = create_app(settings, queue_factory=FakeCompileQueue().bind)
    fresh = {"epsilon": 2.7, "min_examples": 211}  # calibrated nowhere in this process
    with app_in_thread(app) as url:
        admin = httpx.Client(base_url=url, headers=bearer(ADMIN_TOKEN), timeout=120)
        admin.post("/v1/models", json={"name": "tiny", "path": str(make_fake_model(tmp_path / "m"))})
        http = httpx.Client(
            base_url=url, headers=bearer(admin.post("/v1/users", json={"name": "a"}).json()["api_key"]), timeout=120
        )
        r = http.post("/v1/jobs", json={"model": "tiny", "task": "sst2", **SPEC, "privacy": fresh})
        assert r.status_code == 202, r.text
        ledger = http.get("/v1/privacy").json()
    monkeypatch.undo()
    sigma = r.json()["spec"]["privacy"]["noise_multiplier"]
    spent = accounting.epsilon_spent(sigma, 1e-5, SPEC["steps"], SPEC["batch_size"], fresh["min_examples"])
    assert 0.99 * fresh["epsilon"] < spent <= fresh["epsilon"]
    assert ledger["spent"] == spent  # the composition of the worker's curve is the accountant's, exactly
