"""Result uploads: a valid one becomes an adapter version; every bad one is a clear 4xx with nothing stored."""

from __future__ import annotations

import io
import json
import zipfile

import numpy as np
import pytest
from safetensors.numpy import load

from tests.server.factories import (
    b_flat_bytes,
    create_user,
    enroll_device,
    fake_training,
    leased_job,
    submit_job,
    upload,
)


@pytest.fixture
def leased(client, tmp_path):
    return leased_job(client, tmp_path / "model")


def _nothing_stored(client, leased) -> None:
    assert client.get("/v1/adapters", headers=leased["user"]).json()["count"] == 0
    assert client.get(f"/v1/jobs/{leased['job']['id']}", headers=leased["user"]).json()["status"] == "running"
    store = client.app.state.store
    for sub in ("adapters", "logs", "archives", "tmp"):
        assert list((store.root / sub).iterdir()) == [], sub


def test_valid_result_becomes_version_1_and_repeat_is_idempotent(client, leased):
    args = (client, leased["phone"], leased["job"]["id"], b_flat_bytes(leased["b"]), leased["log"])
    first = upload(*args)
    assert first.status_code == 201 and first.json() == {"adapter_id": 1, "version": 1}
    again = upload(*args)
    assert again.status_code == 200 and again.json() == first.json()
    job = client.get(f"/v1/jobs/{leased['job']['id']}", headers=leased["user"]).json()
    assert job["status"] == "succeeded" and job["adapter_id"] == 1
    adapter = client.get("/v1/adapters/1", headers=leased["user"]).json()
    assert adapter["metrics"]["server"]["replay_max_abs_diff"] == 0.0 and adapter["job_id"] == job["id"]
    different = upload(client, leased["phone"], leased["job"]["id"], b_flat_bytes(leased["b"] * 2), leased["log"])
    assert different.status_code == 409


def test_archive_holds_a_peft_adapter_with_the_uploaded_b(client, leased):
    upload(client, leased["phone"], leased["job"]["id"], b_flat_bytes(leased["b"]), leased["log"])
    r = client.get("/v1/adapters/1/download", headers=leased["user"])
    assert r.status_code == 200 and r.headers["content-type"] == "application/zip"
    with zipfile.ZipFile(io.BytesIO(r.content)) as zf:
        names = ["README.md", "adapter_config.json", "adapter_model.safetensors", "mobizo_base.json"]
        assert sorted(zf.namelist()) == [*names, "mobizo_card.json"]
        config = json.loads(zf.read("adapter_config.json"))
        tensors = load(zf.read("adapter_model.safetensors"))
        pinned = json.loads(zf.read("mobizo_base.json"))
        card, readme = json.loads(zf.read("mobizo_card.json")), zf.read("README.md").decode()
    job = client.get(f"/v1/jobs/{leased['job']['id']}", headers=leased["user"]).json()
    assert (
        card["task"] == job["task"]
        and card["prompt"]["objective"] == leased["lease"]["manifest"]["config"]["objective"]
    )
    assert card["provenance"] | {"steps": None} == {
        "job_id": job["id"],
        "steps": None,
        "device_backend": "executorch",
        "federated": False,
        "dp_epsilon": None,
        "replay_verified": True,
    }
    assert card["provenance"]["steps"] == leased["lease"]["spec"]["steps"]
    assert readme.startswith('---\nbase_model: "tiny"\nlibrary_name: peft\n')
    assert config["peft_type"] == "LORA" and config["r"] == 2 and config["target_modules"] == ["q_proj", "v_proj"]
    (model,) = client.get("/v1/models", headers=leased["user"]).json()["data"]
    assert pinned == {"name": model["name"], "sha256": model["sha256"]} and config["base_model_name_or_path"] == "tiny"
    shown = client.get("/v1/adapters/1", headers=leased["user"]).json()
    assert shown["base_sha256"] == model["sha256"]
    config_of = leased["lease"]["manifest"]["config"]
    assert shown["prompt"] == {  # the card's contract, with the chat frame itself
        "task": card["task"],
        "template": card["prompt"]["template"],
        "verbalizer": card["prompt"]["verbalizer"],
        "chat": config_of.get("chat"),
        "objective": card["prompt"]["objective"],
        "prior": card["prompt"]["prior"],
    }
    assert client.get("/v1/adapters", headers=leased["user"]).json()["data"] == [shown]  # the list shows the same
    first = leased["lease"]["manifest"]["lora"][0]
    b0 = tensors[f"base_model.model.{first['name']}.lora_B.weight"]
    np.testing.assert_array_equal(b0.reshape(-1), leased["b"][: b0.size])
    assert tensors[f"base_model.model.{first['name']}.lora_A.weight"].shape == (2, first["in_features"])


def _nan(b):
    bad = b.copy()
    bad[3] = np.nan
    return b_flat_bytes(bad)


def _log_lines(log: str, change) -> str:
    records = [json.loads(line) for line in log.splitlines()]
    change(records)
    return "".join(json.dumps(r) + "\n" for r in records)


BAD_UPLOADS = {
    "non-finite B": (lambda b, log: (_nan(b), log), 422, "NaN"),
    "mis-shaped B": (lambda b, log: (b_flat_bytes(b[:-1]), log), 422, "shape"),
    "wrong tensor name": (lambda b, log: (b_flat_bytes(b, "lora_b"), log), 422, "named"),
    "float64 B": (lambda b, log: (b_flat_bytes(b.astype(np.float64)), log), 422, "dtype"),
    "float16 B": (lambda b, log: (b_flat_bytes(b.astype(np.float16)), log), 422, "dtype"),
    "not safetensors": (lambda b, log: (b"\x00" * 16, log), 422, "b_flat"),
    "oversized B": (lambda b, log: (b_flat_bytes(np.zeros(100_000, np.float32)), log), 413, "larger"),
    "B that the log does not give": (lambda b, log: (b_flat_bytes(b * 1.01), log), 422, "replay"),
    "log with a step missing": (lambda b, log: (b_flat_bytes(b), "".join(log.splitlines(True)[:-1])), 422, "steps"),
    "log with another lr": (
        lambda b, log: (b_flat_bytes(b), _log_lines(log, lambda rs: rs[0].update(lr=1.0))),
        422,
        "lr",
    ),
    "log with forged seeds": (
        lambda b, log: (b_flat_bytes(b), _log_lines(log, lambda rs: [r.update(seed=7) for r in rs])),
        422,
        "seed",
    ),
    "log with a non-finite g": (lambda b, log: (b_flat_bytes(b), log.replace('"g":[', '"g":[NaN,', 1)), 422, "log"),
    "log that is not JSON": (lambda b, log: (b_flat_bytes(b), "step 1\n"), 422, "JSON"),
}


@pytest.mark.parametrize("case", list(BAD_UPLOADS))
def test_bad_uploads_are_rejected_with_nothing_stored(client, leased, case):
    make, code, words = BAD_UPLOADS[case]
    b, log = make(leased["b"], leased["log"])
    r = upload(client, leased["phone"], leased["job"]["id"], b, log)
    assert r.status_code == code, r.text
    detail = r.json()["detail"]
    assert words.lower() in json.dumps(detail).lower()
    _nothing_stored(client, leased)


def test_a_log_that_does_not_follow_the_jobs_lr_schedule_is_rejected(client, tmp_path):
    """The server recomputes each step's lr from the job's schedule (warm-up, then cosine) and takes only those
    float32 bits; the log of a device that ran the base lr throughout is refused, naming the step and the
    schedule's value (not the logged one: errors never echo input)."""
    from server.verify import ResultRejected, read_checked_log
    from shared.schedule import lr_at

    job = leased_job(client, tmp_path / "model", steps=4, lr=0.01, lr_schedule="cosine", warmup_steps=1, lr_floor=0.1)
    spec = job["lease"]["spec"]
    assert (spec["lr_schedule"], spec["warmup_steps"], spec["lr_floor"]) == ("cosine", 1, 0.1)
    expected = [lr_at(0.01, 4, k, "cosine", 1, 0.1) for k in range(4)]
    assert [json.loads(line)["lr"] for line in job["log"].splitlines()] == expected
    assert expected[0] == expected[1] > expected[2] > expected[3]  # warm-up ends at lr, where the decay starts
    constant = _log_lines(job["log"], lambda rs: [r.update(lr=expected[0]) for r in rs])  # steps 0 and 1 are right
    (tmp_path / "constant.jsonl").write_text(constant)
    with pytest.raises(ResultRejected) as caught:
        read_checked_log(str(tmp_path / "constant.jsonl"), spec)
    message = str(caught.value)
    assert "step 2:" in message and "cosine" in message and repr(expected[2]) in message
    assert repr(expected[0]) not in message
    r = upload(client, job["phone"], job["job"]["id"], b_flat_bytes(fake_training(spec, job["b"].size)[0]), constant)
    assert r.status_code == 422 and "step 2" in r.text, r.text
    r = upload(client, job["phone"], job["job"]["id"], b_flat_bytes(job["b"]), job["log"])
    assert r.status_code == 201, r.text  # the log at the schedule's lr is the job's result


def test_bad_metrics_and_missing_parts(client, leased):
    r = upload(client, leased["phone"], leased["job"]["id"], b_flat_bytes(leased["b"]), leased["log"], b"[1, 2]")
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "metrics"]
    files = {"b_flat": ("b.safetensors", b_flat_bytes(leased["b"]))}
    r = client.post(f"/v1/work/job-{leased['job']['id']}/result", files=files, headers=leased["phone"]["headers"])
    assert r.status_code == 422 and "log" in json.dumps(r.json()["detail"])
    _nothing_stored(client, leased)


def test_request_over_the_body_limit_is_413_before_reading_it(client, leased):
    limit = int(client.app.state.settings.max_upload_mb * 1024 * 1024)
    r = client.post(
        f"/v1/work/job-{leased['job']['id']}/result",
        content=b"x" * 10,
        headers={**leased["phone"]["headers"], "Content-Length": str(limit + 1)},
    )
    assert r.status_code == 413


def test_only_the_leasing_device_uploads(client, leased):
    tablet = enroll_device(client, leased["user"], "tablet")
    r = upload(client, tablet, leased["job"]["id"], b_flat_bytes(leased["b"]), leased["log"])
    assert r.status_code == 409
    bobs_phone = enroll_device(client, create_user(client, "bob"))
    assert upload(client, bobs_phone, leased["job"]["id"], b_flat_bytes(leased["b"]), leased["log"]).status_code == 404
    _nothing_stored(client, leased)


def test_upload_after_cancel_is_409(client, leased):
    client.post(f"/v1/jobs/{leased['job']['id']}/cancel", headers=leased["user"])
    r = upload(client, leased["phone"], leased["job"]["id"], b_flat_bytes(leased["b"]), leased["log"])
    assert r.status_code == 409 and "cancelled" in r.json()["detail"]


def test_continued_training_starts_from_the_earlier_adapter(client, leased):
    user, phone = leased["user"], leased["phone"]
    upload(client, phone, leased["job"]["id"], b_flat_bytes(leased["b"]), leased["log"])
    job2 = submit_job(client, user, init_adapter_id=1)
    lease = client.post("/v1/leases", headers=phone["headers"]).json()
    init = client.get(lease["init"]["url"], headers=phone["headers"])
    start = load(init.content)["b_flat"]
    np.testing.assert_array_equal(start, leased["b"])
    b2, log2 = fake_training(lease["spec"], lease["manifest"]["lora_size"], init=start, seed=2)
    # the same log replayed from zero would not give b2: the server must start from the adapter's B
    r = upload(client, phone, job2["id"], b_flat_bytes(b2), log2)
    assert r.status_code == 201 and r.json() == {"adapter_id": 2, "version": 2}
    adapter = client.get("/v1/adapters/2", headers=user).json()
    assert adapter["parent_adapter_id"] == 1 and adapter["version"] == 2


def test_starting_adapter_must_have_the_same_layout(client, leased):
    upload(client, leased["phone"], leased["job"]["id"], b_flat_bytes(leased["b"]), leased["log"])
    body = {"model": "tiny", "task": "sst2", "q": 2, "batch_size": 4, "steps": 3, "rank": 4, "init_adapter_id": 1}
    r = client.post("/v1/jobs", json=body, headers=leased["user"])
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "init_adapter_id"]
    bob = create_user(client, "bob")
    r = client.post("/v1/jobs", json={**body, "rank": 2}, headers=bob)
    assert r.status_code == 404


def test_adapters_are_scoped_and_versioned_per_task(client, leased):
    upload(client, leased["phone"], leased["job"]["id"], b_flat_bytes(leased["b"]), leased["log"])
    bob = create_user(client, "bob")
    assert client.get("/v1/adapters/1", headers=bob).status_code == 404
    assert client.get("/v1/adapters/1/download", headers=bob).status_code == 404
    assert client.get("/v1/adapters", headers=bob).json()["count"] == 0
    assert client.get("/v1/adapters", params={"task": "rte"}, headers=leased["user"]).json()["count"] == 0
    assert client.get("/v1/adapters", params={"task": "sst2"}, headers=leased["user"]).json()["count"] == 1


def test_an_optimizers_result_is_its_replay_with_the_state_rebuilt_from_the_log(client, tmp_path):
    """A normalized job: the lease's program and spec carry the optimizer; the log's lr must be the schedule's with
    normalized's bias correction, and B the replay under normalized (the state rebuilt from the logged g). The sgd
    meaning of the same log, or the uncorrected lr, is refused."""
    import torch

    from server.verify import expected_lr
    from shared.replay import replay
    from shared.schedule import lr_at

    job = leased_job(client, tmp_path / "model", steps=4, lr=0.01, optimizer="normalized")
    spec, records = job["lease"]["spec"], [json.loads(line) for line in job["log"].splitlines()]
    assert spec["optimizer"] == job["lease"]["manifest"]["config"]["optimizer"] == "normalized"
    scheduled = [lr_at(0.01, 4, k, spec["lr_schedule"]) for k in range(4)]
    assert [r["lr"] for r in records] == [expected_lr(spec, k) for k in range(4)] and records[0]["lr"] < scheduled[0]
    as_sgd = replay(torch.zeros(job["b"].size), records).numpy()
    r = upload(client, job["phone"], job["job"]["id"], b_flat_bytes(as_sgd), job["log"])
    assert r.status_code == 422 and "replay" in r.text, r.text
    uncorrected = _log_lines(job["log"], lambda rs: [rec.update(lr=lr) for rec, lr in zip(rs, scheduled, strict=True)])
    r = upload(client, job["phone"], job["job"]["id"], b_flat_bytes(job["b"]), uncorrected)
    assert r.status_code == 422 and "step 0: lr" in r.text, r.text
    r = upload(client, job["phone"], job["job"]["id"], b_flat_bytes(job["b"]), job["log"])
    assert r.status_code == 201, r.text


def test_a_forged_log_beyond_the_optimizers_bound_is_refused(client, tmp_path):
    """The bound on |g| holds whatever the optimizer: a momentum log whose g is not what its losses give, or whose
    losses leave [0, MAX_LOSS] to make g large, is refused before any replay."""
    from server.verify import MAX_LOSS

    job = leased_job(client, tmp_path / "model", steps=3, optimizer="momentum")

    def huge_g(records):
        records[1]["g"] = [1e6] * len(records[1]["g"])

    def huge_losses(records):
        records[1]["losses"][0] = MAX_LOSS * 10
        records[1]["g"][0] = (records[1]["losses"][0] - records[1]["losses"][1]) / (2 * records[1]["eps"])

    for forge, words in ((huge_g, "follow from the losses"), (huge_losses, "finite number")):
        r = upload(client, job["phone"], job["job"]["id"], b_flat_bytes(job["b"]), _log_lines(job["log"], forge))
        assert r.status_code == 422 and "step 1" in r.text and words in r.text, r.text
    _nothing_stored(client, job)


def test_listing_adapters_costs_the_same_statements_however_many_there_are(client, leased):
    """Each adapter's answer holds its job's prompt contract (from the job's program): the list loads the page's
    jobs and programs with it, so its SQL statements do not grow with the page."""
    import gc
    import threading

    from sqlalchemy import event

    user, phone = leased["user"], leased["phone"]
    assert upload(client, phone, leased["job"]["id"], b_flat_bytes(leased["b"]), leased["log"]).status_code == 201
    engine = client.app.state.engine
    statements: list[str] = []

    def count(*args) -> None:
        if not threading.current_thread().name.endswith("-sweeper"):  # the server's own background statements
            statements.append(args[2])
        gc.collect()  # the session keeps what nobody holds only weakly: a row loaded and let go is read again

    def listed() -> int:
        statements.clear()
        gc.freeze()  # each collection then scans only what the request made (quick in a worker holding the suite)
        event.listen(engine, "before_cursor_execute", count)
        try:
            shown = client.get("/v1/adapters", headers=user).json()
        finally:
            event.remove(engine, "before_cursor_execute", count)
            gc.unfreeze()
        assert all(a["prompt"]["objective"] for a in shown["data"])
        return len(statements)

    one = listed()
    for task in ("rte", "boolq"):
        job = submit_job(client, user, task=task)
        lease = client.post("/v1/leases", headers=phone["headers"]).json()
        b, log = fake_training(lease["spec"], lease["manifest"]["lora_size"])
        assert upload(client, phone, job["id"], b_flat_bytes(b), log).status_code == 201
    assert client.get("/v1/adapters", headers=user).json()["count"] == 3
    assert listed() == one, "\n".join(statements)
