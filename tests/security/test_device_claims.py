"""What a device may claim beside its log: the metrics it uploads and the losses in its heartbeats.

The log is verified by replay; the metrics are the device's word. So the server bounds them (every loss in
[0, MAX_LOSS], accuracies in [0, 1], times and sizes non-negative), stores the verified log's own per-step losses
instead of the device's, and refuses any loss or held-out figure from a private job, whose losses stay on the
device. A forged upload's losses one ulp apart once hung the dashboard on the first view of its page.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from server.tables import Job
from shared.schemas import MAX_LOSS
from tests.server.factories import (
    b_flat_bytes,
    create_user,
    enroll_device,
    leased_job,
    make_fake_model,
    register_model,
    submit_job,
    upload,
)
from tests.server.test_dashboard import browser, key_of, sign_in


def _log_means(log: str) -> list[float]:
    return [float(np.mean(json.loads(line)["losses"])) for line in log.splitlines()]


def test_the_stored_losses_are_the_logs_and_the_page_draws_them(client, tmp_path) -> None:
    client = browser(client)
    work = leased_job(client, tmp_path / "model", steps=4)
    forged = json.dumps({"steps": 4, "losses": [0.5, 0.5000000000000001, 0.5, 0.5000000000000001]}).encode()
    r = upload(client, work["phone"], work["job"]["id"], b_flat_bytes(work["b"]), work["log"], forged)
    assert r.status_code == 201, r.text
    stored = client.get(f"/v1/adapters/{r.json()['adapter_id']}", headers=work["user"]).json()["metrics"]
    assert stored["losses"] == _log_means(work["log"]) != json.loads(forged)["losses"]
    sign_in(client, key_of(work["user"]))
    page = client.get(f"/ui/jobs/{work['job']['id']}")
    assert page.status_code == 200 and 'data-series="training loss" data-points="4"' in page.text


@pytest.mark.parametrize(
    ("claim", "where"),
    [
        ({"losses": [1.0, 1e308]}, "losses.1"),
        ({"losses": [-1.0]}, "losses.0"),
        ({"eval": [{"step": 0, "loss": -1e308}]}, "eval.0.loss"),
        ({"eval": [{"step": 0, "loss": MAX_LOSS * 2}]}, "eval.0.loss"),
        ({"eval": [{"step": 0, "accuracy": 1.5}]}, "eval.0.accuracy"),
        ({"step_time_s": -1.0}, "step_time_s"),
    ],
)
def test_metrics_out_of_bounds_are_refused_naming_the_field(client, tmp_path, claim, where) -> None:
    work = leased_job(client, tmp_path / "model", steps=3)
    metrics = json.dumps({"steps": 3, **claim}).encode()
    r = upload(client, work["phone"], work["job"]["id"], b_flat_bytes(work["b"]), work["log"], metrics)
    detail = r.json()["detail"][0]
    assert r.status_code == 422 and detail["loc"] == ["body", "metrics"] and detail["msg"].startswith(f"{where}:")


PRIVATE = {"epsilon": 3.0, "min_examples": 100}


@pytest.fixture
def private_lease(client, tmp_path):
    register_model(client, make_fake_model(tmp_path / "model"))
    user = create_user(client)
    phone = enroll_device(client, user)
    job = submit_job(client, user, privacy=PRIVATE, q=2, batch_size=4, steps=3)
    lease = client.post("/v1/leases", headers=phone["headers"]).json()
    assert lease["job_id"] == job["id"]
    return {"user": user, "phone": phone, "job": job, "lease": lease}


def test_a_private_jobs_heartbeat_carries_no_loss(client, private_lease) -> None:
    job_id, phone = private_lease["job"]["id"], private_lease["phone"]
    r = client.post(f"/v1/work/job-{job_id}/heartbeat", json={"step": 1, "loss": 0.7}, headers=phone["headers"])
    assert r.status_code == 422 and "loss" in r.text, r.text
    r = client.post(f"/v1/work/job-{job_id}/heartbeat", json={"step": 1}, headers=phone["headers"])
    assert r.status_code == 200, r.text
    with client.app.state.sessionmaker() as session:
        stored = session.get(Job, job_id)
        assert stored.progress_step == 1 and stored.progress_loss is None


@pytest.mark.parametrize(
    ("claim", "field"), [({"losses": [0.5, 0.6, 0.7]}, "losses"), ({"eval": [{"step": 0, "accuracy": 0.5}]}, "eval")]
)
def test_a_private_jobs_metrics_carry_no_losses_or_held_out_figures(client, private_lease, claim, field) -> None:
    from tests.server.factories import fake_training

    lease = private_lease["lease"]
    b, log = fake_training(lease["spec"], lease["manifest"]["lora_size"])
    metrics = json.dumps({"steps": 3, **claim}).encode()
    r = upload(client, private_lease["phone"], lease["job_id"], b_flat_bytes(b), log, metrics)
    detail = r.json()["detail"][0]
    assert r.status_code == 422 and detail["msg"].startswith(f"{field}: a private job's"), r.text
    r = upload(client, private_lease["phone"], lease["job_id"], b_flat_bytes(b), log, b'{"steps": 3}')
    assert r.status_code == 201, r.text
