"""Jobs compiled and results verified by real ``mobizo worker`` processes through the local Redis
(``MOBIZO_QUEUE=celery``).

``mobizo server`` processes and workers share a data dir and a database (SQLite; PostgreSQL for the test with two
API processes, skipped with the reason when MOBIZO_TEST_DATABASE_URL is unset); the broker is the machine's Redis
on loopback (skipped with the reason when it does not answer). The exports are real (tiny model).
"""

from __future__ import annotations

import hashlib
import random
import re
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from safetensors.numpy import load

from server.app import create_app
from server.object_store import parse_store_url
from server.settings import Settings
from tests.server.conftest import pg_schema
from tests.server.factories import (
    ADMIN,
    ADMIN_TOKEN,
    FakeCompileQueue,
    b_flat_bytes,
    bearer,
    create_user,
    enroll_device,
    fake_training,
    make_fake_model,
    register_model,
    submit_job,
    upload,
)
from tests.server.live import kill_group, server_process, worker_process
from tests.utils.processes import exited
from tests.utils.s3 import new_bucket, s3_env

pytestmark = pytest.mark.slow

REDIS = ("127.0.0.1", 6379)
VISIBILITY_S = 5  # short, so that the task of a killed worker comes back within the test
# The suite's TINY_Q1 program: where a test's subject is not the export itself, the worker finds it compiled
# (``seed``, from the suite's program cache) instead of exporting it again.
SPEC = {"model": "tiny", "task": "sst2", "q": 1, "batch_size": 2, "steps": 2, "rank": 2, "alpha": 4.0, "seq_len": 16}
SPEC["answer_len"] = 2


def _redis_answers() -> bool:
    try:
        with socket.create_connection(REDIS, timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@pytest.fixture
def broker_url() -> str:
    """A Redis database of its own (1-15, chosen at random) with no compile or verify tasks left in it."""
    if not _redis_answers():
        pytest.skip(f"no Redis answering on {REDIS[0]}:{REDIS[1]} (the Celery broker of these tests)")
    import redis

    db = random.randint(1, 15)
    client = redis.Redis(*REDIS, db=db)
    client.delete("compile", "verify", "unacked", "unacked_index")
    client.close()
    return f"redis://{REDIS[0]}:{REDIS[1]}/{db}"


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One data dir for the module, as a shared volume would be: a config compiled by one test is cached for the
    next (each test still works alone, exporting what it needs)."""
    return tmp_path_factory.mktemp("artifacts")


@pytest.fixture
def seed(artifacts: Path, tiny_model_dir: Path, program_factory) -> Callable[[], None]:
    """Puts SPEC's program in the shared data dir's compile cache, as if a worker had compiled it before."""
    from tests.utils.program_cache import seed_server_program
    from tests.utils.programs import TINY_Q1

    def put() -> None:
        assert seed_server_program(artifacts, tiny_model_dir, SPEC, program_factory) == TINY_Q1

    return put


@pytest.fixture
def env(tmp_path: Path, broker_url: str, artifacts: Path) -> dict[str, str]:
    return {
        "MOBIZO_QUEUE": "celery",
        "MOBIZO_BROKER_URL": broker_url,
        "MOBIZO_BROKER_VISIBILITY_TIMEOUT_S": str(VISIBILITY_S),
        "MOBIZO_DATA_DIR": str(artifacts),
        "DATABASE_URL": f"sqlite:///{tmp_path / 'mobizo.db'}",
        "MOBIZO_ADMIN_TOKEN": ADMIN_TOKEN,
    }


@pytest.fixture
def server(env: dict[str, str], tmp_path: Path) -> Iterator[str]:
    with server_process(env, tmp_path / "server.log") as url:
        yield url


def _ok(response: httpx.Response, code: int = 200) -> dict:
    assert response.status_code == code, response.text
    return response.json()


def _user(server: str, model_dir: Path) -> httpx.Client:
    admin = httpx.Client(base_url=server, headers=bearer(ADMIN_TOKEN), timeout=60)
    key = _ok(admin.post("/v1/users", json={"name": "alice"}), 201)["api_key"]
    _ok(admin.post("/v1/models", json={"name": "tiny", "path": str(model_dir)}), 201)
    return httpx.Client(base_url=server, headers=bearer(key), timeout=60)


def _wait_for(user: httpx.Client, job_id: int, statuses: set[str], timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = _ok(user.get(f"/v1/jobs/{job_id}"))
        if job["status"] in statuses:
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} still {job['status']} after {timeout} s")


def test_a_job_survives_its_worker_being_killed_mid_compile(server, env, seed, tmp_path, tiny_model_dir):
    """Worker 1 takes the task and is SIGKILLed (its whole process group) while exporting; the task is not
    acknowledged, so the broker gives it to worker 2 after the visibility timeout, which takes over the job left
    ``compiling`` and makes it ready. The program the worker found is what the API then hands a device.

    Worker 2 finds the program compiled (seeded after the kill, as a worker of another machine could have published
    it): that it takes the job over is the subject, and an export it would finish is test_e2e's."""
    user = _user(server, tiny_model_dir)
    published = _programs(env)
    with worker_process(env, tmp_path / "worker1.log", queues="compile") as first:
        job = _ok(user.post("/v1/jobs", json=SPEC), 202)
        _wait_for(user, job["id"], {"compiling"}, timeout=120)
        kill_group(first, signal.SIGKILL)
    time.sleep(1)
    assert _ok(user.get(f"/v1/jobs/{job['id']}"))["status"] == "compiling"  # nobody else had it
    assert _programs(env) == published  # worker 1 died before it could publish a program
    seed()
    with worker_process(env, tmp_path / "worker2.log", queues="compile"):
        done = _wait_for(user, job["id"], {"ready", "failed", "cancelled"})
    assert done["status"] == "ready", done["error"]

    code = _ok(user.post("/v1/enrollment-codes", json={}), 201)["code"]
    enrolled = _ok(
        httpx.post(f"{server}/v1/devices", json={"code": code, "name": "phone", "backend": "executorch"}), 201
    )
    device = httpx.Client(base_url=server, headers=bearer(enrolled["token"]), timeout=60)
    lease = _ok(device.post("/v1/leases"))
    assert lease["job_id"] == job["id"]
    program = device.get(lease["program"]["url"]).raise_for_status().content
    assert hashlib.sha256(program).hexdigest() == lease["program"]["sha256"]


def _programs(env: dict[str, str]) -> set[str]:
    return {p.name for p in (Path(env["MOBIZO_DATA_DIR"]) / "programs").glob("[0-9a-f]*")}


def test_cancel_kills_the_running_export(server, env, broker_url, seed, tmp_path, tiny_model_dir):
    """Cancelling a compiling job revokes its task: the pool process running the export is killed, no program is
    published, the job stays cancelled, and the worker goes on with the next task."""
    from server.celery_queue import compile_task_id, make_celery

    user = _user(server, tiny_model_dir)
    inspector = make_celery(Settings(broker_url=broker_url)).control.inspect(timeout=2)
    published = _programs(env)
    with worker_process(env, tmp_path / "worker.log", queues="compile"):
        job = _ok(user.post("/v1/jobs", json={**SPEC, "q": 2, "batch_size": 4}), 202)  # a config not cached
        _wait_for(user, job["id"], {"compiling"}, timeout=120)
        active = [task for tasks in (inspector.active() or {}).values() for task in tasks]
        assert [t["id"] for t in active] == [compile_task_id(job["id"])]
        exporter = active[0]["worker_pid"]
        assert not exited(exporter)
        assert _ok(user.post(f"/v1/jobs/{job['id']}/cancel"))["status"] == "cancelled"
        deadline = time.monotonic() + 30
        while not exited(exporter):
            assert time.monotonic() < deadline, f"export process {exporter} still running after the cancel"
            time.sleep(0.1)
        time.sleep(2 * VISIBILITY_S)  # past the visibility timeout: a redelivered task would have started by now
        assert _ok(user.get(f"/v1/jobs/{job['id']}"))["status"] == "cancelled"
        assert _programs(env) == published  # nothing published

        seed()
        other = _ok(user.post("/v1/jobs", json=SPEC), 202)
        assert _wait_for(user, other["id"], {"ready", "failed"})["status"] == "ready"


def test_inference_programs_are_built_by_the_compile_queues_workers(server, env, tmp_path, tiny_model_dir):
    """An inference program is an export like a job's: the API process sends it to the compile queue and answers 503
    until a worker has built it; then its files download by content."""
    user = _user(server, tiny_model_dir)
    code = _ok(user.post("/v1/enrollment-codes", json={}), 201)["code"]
    enrolled = _ok(
        httpx.post(f"{server}/v1/devices", json={"code": code, "name": "phone", "backend": "executorch"}), 201
    )
    device = httpx.Client(base_url=server, headers=bearer(enrolled["token"]), timeout=60)
    body = {"model": "tiny", "config": {"max_context": 32, "rank": 2, "alpha": 4.0}}
    before = _programs(env)
    for _ in range(10):  # no worker: the API process does not build it itself
        assert device.post("/v1/device/inference", json=body).status_code == 503
        time.sleep(0.3)
    assert _programs(env) == before
    with worker_process(env, tmp_path / "worker.log", queues="compile"):
        deadline = time.monotonic() + 600
        while (r := device.post("/v1/device/inference", json=body)).status_code == 503:
            assert time.monotonic() < deadline, "no worker built the inference program in 10 minutes"
            time.sleep(0.5)
    served = _ok(r)
    assert _programs(env) - before == {served["key"]}
    program = device.get(served["program"]["url"]).raise_for_status().content
    assert hashlib.sha256(program).hexdigest() == served["program"]["sha256"]


@pytest.fixture(params=["volume", "bucket"])
def storage(request: pytest.FixtureRequest, env: dict[str, str], tmp_path: Path, monkeypatch) -> dict:
    """How the verify worker reaches the upload's files: ``volume``, the API process's data dir (shared); ``bucket``,
    a data dir of its own and an S3 bucket (``MOBIZO_STORE_URL``) that both use → the worker's env, the app's
    ``store_url`` and (bucket only) a boto3 client of the bucket."""
    if request.param == "volume":
        return {"worker_env": env, "store_url": None, "bucket": None}
    import boto3

    endpoint = request.getfixturevalue("s3_endpoint")
    for name, value in s3_env(endpoint).items():
        monkeypatch.setenv(name, value)  # the app (in this process) reads them when it makes its client
    store_url = new_bucket(endpoint)
    # versioned, so that the spool a task uploaded and then deleted still shows (``_spooled``)
    boto3.client("s3").put_bucket_versioning(
        Bucket=parse_store_url(store_url)[0], VersioningConfiguration={"Status": "Enabled"}
    )
    worker_env = {**env, **s3_env(endpoint), "MOBIZO_STORE_URL": store_url, "MOBIZO_DATA_DIR": str(tmp_path / "w")}
    return {"worker_env": worker_env, "store_url": store_url, "bucket": (boto3.client("s3"), store_url)}


def _celery_settings(env: dict[str, str], storage: dict) -> Settings:
    return Settings(
        data_dir=Path(env["MOBIZO_DATA_DIR"]),
        database_url=env["DATABASE_URL"],
        admin_token=ADMIN_TOKEN,
        queue="celery",
        broker_url=env["MOBIZO_BROKER_URL"],
        store_url=storage["store_url"],
    )


def _check_spool(storage: dict, tasks: int, answered: int) -> None:
    """With a bucket, each of ``tasks`` verify tasks sent its inputs through it (``in-*`` objects under a
    ``tmp/verify-*`` of its own) and the ``answered`` ones (not rejected) their outputs (``out-*``); the API process
    deleted them all afterwards."""
    if storage["bucket"] is None:
        return
    client, url = storage["bucket"]
    bucket, prefix = parse_store_url(url)
    assert client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}tmp/").get("KeyCount", 0) == 0
    versions = client.list_object_versions(Bucket=bucket, Prefix=f"{prefix}tmp/").get("Versions", [])
    spools = {
        kind: {v["Key"].split("/")[-2] for v in versions if v["Key"].split("/")[-1].startswith(kind)}
        for kind in ("in-", "out-")
    }
    assert (len(spools["in-"]), len(spools["out-"])) == (tasks, answered), spools
    assert spools["out-"] <= spools["in-"]


def test_a_merged_download_is_built_by_a_worker_of_the_compile_queue(env, tmp_path, tiny_model_dir):
    """``GET /v1/adapters/{id}/merged`` on a server of the Celery queue: 503 + Retry-After while a worker of the
    compile queue folds the adapter into its base (``mobizo.merge``), then the zip from the shared data dir."""
    import io
    import zipfile

    from tests.server.factories import InlinePool
    from tests.server.test_merged import _adapter

    local = Settings(data_dir=Path(env["MOBIZO_DATA_DIR"]), database_url=env["DATABASE_URL"], admin_token=ADMIN_TOKEN)
    with TestClient(create_app(local, queue_factory=FakeCompileQueue().bind)) as client:  # the adapter, made here
        client.app.state.verify_pool = InlinePool()
        register_model(client, tiny_model_dir)
        user = create_user(client)
        adapter_id = _adapter(client, user, enroll_device(client, user))
    log_file = tmp_path / "worker.log"
    with (
        server_process(env, tmp_path / "server.log") as url,
        worker_process(env, log_file, queues="compile"),
        httpx.Client(base_url=url, headers=user, timeout=60) as http,
    ):
        first = http.get(f"/v1/adapters/{adapter_id}/merged", params={"dtype": "bfloat16"})
        assert first.status_code == 503 and int(first.headers["retry-after"]) >= 1, first.text
        deadline = time.monotonic() + 300
        while (r := http.get(f"/v1/adapters/{adapter_id}/merged", params={"dtype": "bfloat16"})).status_code == 503:
            assert time.monotonic() < deadline, log_file.read_text()[-3000:]
            time.sleep(0.5)
        assert r.status_code == 200 and zipfile.ZipFile(io.BytesIO(r.content)).testzip() is None, r.text
    assert "mobizo.merge[" in log_file.read_text()


def test_uploads_are_verified_by_a_worker_of_the_verify_queue(env, storage, tmp_path):
    """The upload route waits on the verify task: a B the log does not replay to is a 422 naming ``b_flat``, the
    right one a 201 with the replay's checks, both answered by a worker that takes only the verify queue; with a
    bucket the worker shares no folder with the API process."""
    log_file = tmp_path / "worker.log"
    with TestClient(create_app(_celery_settings(env, storage), queue_factory=FakeCompileQueue().bind)) as client:
        register_model(client, make_fake_model(tmp_path / "model"))
        user = create_user(client)
        phone = enroll_device(client, user)
        job = submit_job(client, user)
        lease = client.post("/v1/leases", headers=phone["headers"]).json()
        b, log = fake_training(lease["spec"], lease["manifest"]["lora_size"])
        with worker_process(storage["worker_env"], log_file, queues="verify"):
            wrong = upload(client, phone, job["id"], b_flat_bytes(b * 2), log)
            right = upload(client, phone, job["id"], b_flat_bytes(b), log)
        assert wrong.status_code == 422 and wrong.json()["detail"][0]["loc"][-1] == "b_flat", wrong.text
        assert right.status_code == 201, right.text
        adapter = client.get(f"/v1/adapters/{right.json()['adapter_id']}", headers=user).json()
        assert adapter["metrics"]["server"]["replay_max_abs_diff"] == 0.0
        download = client.get(f"/v1/adapters/{adapter['id']}/download", headers=user)
        assert download.status_code == 200 and download.content[:2] == b"PK"  # the worker's archive
    assert log_file.read_text().count("mobizo.verify[") >= 4  # two tasks, each received and succeeded
    _check_spool(storage, tasks=2, answered=1)  # the wrong B was rejected


def test_a_round_is_replayed_and_closed_by_the_verify_queue(env, storage, tmp_path):
    """A federated round through the verify queue: each client's log is replayed there (``replay_log_only``) and
    the K-th report closes the round, whose PEFT archive a worker packages (``package_adapter``); the round's B is
    the offline recomputation from the accepted logs, bit for bit."""
    from tests.server.test_federation import HYPER, _recompute

    settings = _celery_settings(env, storage)
    with TestClient(create_app(settings, queue_factory=FakeCompileQueue().bind)) as client:
        register_model(client, make_fake_model(tmp_path / "model"))
        users = [create_user(client, name) for name in ("a", "b")]
        devices = [enroll_device(client, key, f"phone-{i}") for i, key in enumerate(users)]
        cohort = client.post("/v1/cohorts", json={"name": "c", "model": "tiny", "task": "sst2"}, headers=ADMIN)
        for key in users:
            assert client.post(f"/v1/cohorts/{cohort.json()['id']}/join", headers=key).status_code == 200
        body = {
            **HYPER,
            "rounds": 1,
            "clients_per_round": 2,
            "min_clients": 2,
            "round_timeout_s": 600,
            "global_lr": 0.5,
        }
        job = client.post(f"/v1/cohorts/{cohort.json()['id']}/jobs", json=body, headers=ADMIN).json()
        with worker_process(storage["worker_env"], tmp_path / "worker.log", queues="verify"):
            for seed, device in enumerate(devices):
                lease = client.post("/v1/leases", json={"eligible": True}, headers=device["headers"]).json()
                init = load(client.get(lease["init"]["url"], headers=device["headers"]).content)["b_flat"]
                _, log = fake_training(lease["spec"], lease["manifest"]["lora_size"], init, seed=seed)
                files = {"log": ("log.jsonl", log.encode()), "metrics": ("metrics.json", b"{}")}
                url = f"/v1/work/part-{lease['round']['client_id']}/result"
                reported = client.post(url, files=files, headers=device["headers"])
                assert reported.status_code == 201, reported.text
            # The K-th report closes the round, unless the app's sweeper found it full first and is closing it in
            # its own thread (the report then answers at once): wait for the close, with the worker still there.
            deadline = time.monotonic() + 120
            while (done := client.get(f"/v1/jobs/{job['id']}", headers=ADMIN).json())["status"] == "running":
                assert time.monotonic() < deadline, "the full round was not closed within 120 s"
                time.sleep(0.2)
        assert done["status"] == "succeeded", done["error"]
        (round_,) = client.get(f"/v1/jobs/{job['id']}/rounds", headers=ADMIN).json()["data"]
        adapter = client.get(f"/v1/adapters/{round_['adapter_id']}", headers=users[0]).json()
        stored = load((settings.data_dir / "adapters" / f"{adapter['b_sha256']}.safetensors").read_bytes())
        expected = _recompute(settings.data_dir, round_, 0.5)[0]
        assert np.array_equal(stored["b_flat"].view(np.int32), expected.view(np.int32))
        download = client.get(f"/v1/adapters/{adapter['id']}/download", headers=users[0])
        assert download.status_code == 200 and download.content[:2] == b"PK"
    _check_spool(storage, tasks=3, answered=3)  # two replays and the round's archive


def test_two_api_processes_on_postgresql_share_the_queue(env, seed, tmp_path, tiny_model_dir, pg_url):
    """``mobizo server --workers 2`` on PostgreSQL: two API processes start together (one migrates and recovers
    under the advisory lock, the other waits), a job submitted through them is compiled by the worker, and a
    revoked device is refused by both from the next request on."""
    log_file = tmp_path / "server.log"
    seed()
    with pg_schema(pg_url) as db:
        pg_env = {**env, "DATABASE_URL": db}
        with server_process(pg_env, log_file, workers=2) as url:
            user = _user(url, tiny_model_dir)
            with worker_process(pg_env, tmp_path / "worker.log", queues="compile"):
                job = _ok(user.post("/v1/jobs", json=SPEC), 202)
                done = _wait_for(user, job["id"], {"ready", "failed"})
            assert done["status"] == "ready", done["error"]
            jobs = [_ok(user.get("/v1/jobs"))["count"] for _ in range(20)]  # answered by either process
            assert jobs == [1] * 20
            # A device known to both processes (each has checked its token) is refused by both once revoked.
            code = _ok(user.post("/v1/enrollment-codes", json={}), 201)["code"]
            body = {"code": code, "name": "phone", "backend": "executorch"}
            enrolled = _ok(httpx.post(f"{url}/v1/devices", json=body), 201)
            device = httpx.Client(base_url=url, headers=bearer(enrolled["token"]), timeout=60)
            assert [device.get("/v1/models").status_code for _ in range(20)] == [200] * 20
            _ok(user.post(f"/v1/devices/{enrolled['device_id']}/revoke"))
            refused = [device.get("/v1/models") for _ in range(20)]
            assert all(r.status_code == 401 and "revoked" in r.json()["detail"] for r in refused)
    text = log_file.read_text()
    started = set(re.findall(r"Started server process \[(\d+)\]", text))
    assert len(started) == 2, text[-3000:]
    recovered, waited = text.count("startup: resubmitted"), text.count("startup: another API process")
    assert recovered >= 1 and recovered + waited == 2, text[-3000:]
