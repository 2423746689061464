"""Issue 25 point 2: ``server.limits`` took only ``/v1/jobs/{id}/result`` for an upload, so a round part's log
(``/v1/round-clients/{id}/result``) fell under the 64 KB JSON cap and a round part of ~200+ steps could never report.
Now every work item uploads to one route, named in one place (``server.limits.WORK_UPLOAD``), and its cap follows
from the item's parts' limits (``upload_body_limit``).

The round part here is 2,000 steps at q = 16: its log (about 2 MB) is written with the project's own log writer
(``shared.train_log``: the job's seeds and lr, g from the losses) and uploaded over a real loopback socket to the app
served by uvicorn, which replays it (the test's one cost: some 10-25 s of replay); a real agent would need a compiled
program and minutes of training for the same bytes. Then (issue 25 point 6) the round's cohort adapter, which the
members may download, is served to the devices of members (and of no one else) for inference.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from server.limits import JSON_LIMIT, WORK_UPLOAD, body_limit
from server.settings import Settings
from server.verify import expected_lr
from shared.noise import step_seed
from shared.train_log import log_line, log_record
from tests.security.servers import app_server
from tests.server.factories import (
    ADMIN,
    ADMIN_TOKEN,
    FakeCompileQueue,
    create_user,
    enroll_device,
    make_fake_model,
    register_model,
)
from tests.server.test_federation import wait_for

STEPS, Q = 2000, 16


def round_log(spec: dict) -> str:
    """The log a device could have written for the part (``factories.fake_training``'s, without computing its B:
    the server replays it, the test need not): the job's seeds and lr schedule, random losses and their g."""
    rng = np.random.default_rng(0)
    lines = []
    for step in range(spec["steps"]):
        losses = rng.uniform(1, 2, size=2 * spec["q"]).astype(np.float32)
        g = (losses[0::2] - losses[1::2]) / (np.float32(spec["eps"]) * np.float32(2))
        seed = step_seed(spec["seed"], step)
        lines.append(log_line(log_record(step, seed, expected_lr(spec, step), spec["eps"], g, losses)))
    return "".join(lines)


@pytest.fixture(scope="module")
def cohort(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """A cohort with members a and b (a device each) and an outsider n; a one-round federated job of K = 1."""
    root = tmp_path_factory.mktemp("round-uploads")
    settings = Settings(data_dir=root / "data", database_url=f"sqlite:///{root / 'mobizo.db'}", admin_token=ADMIN_TOKEN)
    with app_server(settings, FakeCompileQueue()) as (url, app), httpx.Client(base_url=url, timeout=120) as http:
        register_model(http, make_fake_model(root / "model"))
        users = {name: create_user(http, name) for name in "abn"}
        devices = {name: enroll_device(http, key, f"phone-{name}") for name, key in users.items()}
        r = http.post("/v1/cohorts", json={"name": "big", "model": "tiny", "task": "sst2"}, headers=ADMIN)
        cohort_id = r.json()["id"]
        for name in "ab":
            assert http.post(f"/v1/cohorts/{cohort_id}/join", headers=users[name]).status_code == 200
        spec = {"q": Q, "batch_size": Q, "steps": STEPS, "rank": 2, "rounds": 1, "clients_per_round": 1}
        r = http.post(f"/v1/cohorts/{cohort_id}/jobs", json=spec, headers=ADMIN)
        assert r.status_code == 202, r.text
        yield {"http": http, "app": app, "users": users, "devices": devices, "job": r.json(), "cohort": cohort_id}


def test_every_multipart_route_is_an_upload_route_with_the_upload_cap(cohort):
    paths = cohort["app"].openapi()["paths"]
    multipart = {
        path
        for path, operations in paths.items()
        for operation in operations.values()
        if "multipart/form-data" in operation.get("requestBody", {}).get("content", {})
    }
    assert multipart == {WORK_UPLOAD}
    for work in ("job-7", "part-7"):
        assert body_limit("POST", WORK_UPLOAD.format(work=work), 10**9) == 10**9
    assert body_limit("POST", "/v1/work/part-7/heartbeat", 10**9) == JSON_LIMIT


def test_a_round_part_of_2000_steps_at_q16_reports(cohort):
    http, device = cohort["http"], cohort["devices"]["a"]["headers"]
    lease = http.post("/v1/leases", json={"eligible": True}, headers=device).json()
    assert lease["round"] is not None and lease["spec"]["steps"] == STEPS and lease["spec"]["q"] == Q
    assert http.get(lease["init"]["url"], headers=device).status_code == 200
    log = round_log(lease["spec"])
    assert len(log) > 30 * JSON_LIMIT  # about 2 MB: thirty times the cap it used to fall under
    files = {"log": ("log.jsonl", io.BytesIO(log.encode())), "metrics": ("metrics.json", io.BytesIO(b"{}"))}
    url = f"/v1/work/part-{lease['round']['client_id']}/result"
    response = http.post(url, files=files, headers=device)
    assert response.status_code == 201, response.text
    # the K-th report closes the round, unless the round sweeper (every 0.5 s) began closing it first: then the report
    # answers while the sweeper is still packaging, and the job succeeds moments later
    job = wait_for(
        lambda: (j := http.get(f"/v1/jobs/{cohort['job']['id']}", headers=ADMIN).json())["status"] != "running" and j,
        60,
        "the round to close",
    )
    assert job["status"] == "succeeded", job
    (round_,) = http.get(f"/v1/jobs/{cohort['job']['id']}/rounds", headers=ADMIN).json()["data"]
    assert round_["status"] == "closed" and round_["clients"][0]["status"] == "reported"
    cohort["adapter_id"] = round_["adapter_id"]


def test_members_devices_run_the_cohort_adapter_and_no_one_elses(cohort, tmp_path: Path):
    # the module's round, closed by the test before (a failure there fails this too, never skips it)
    assert "adapter_id" in cohort, "needs the round of test_a_round_part_of_2000_steps_at_q16_reports"
    http, adapter_id = cohort["http"], cohort["adapter_id"]
    url = f"/v1/device/adapters/{adapter_id}"
    for member in "ab":  # b did not train in the round: what b may download, b's devices may run
        headers = cohort["devices"][member]["headers"]
        shown = http.get(url, headers=headers)
        assert shown.status_code == 200 and shown.json()["cohort_id"] == cohort["cohort"], shown.text
        b = http.get(f"/v1/blobs/{shown.json()['b_sha256']}", headers=headers)
        assert b.status_code == 200 and b.headers["etag"] == f'"{shown.json()["b_sha256"]}"'
        assert http.get(f"/v1/adapters/{adapter_id}/download", headers=cohort["users"][member]).status_code == 200
    outsider = cohort["devices"]["n"]["headers"]
    assert http.get(url, headers=outsider).status_code == 404
    b_url = f"/v1/blobs/{http.get(url, headers=cohort['devices']['a']['headers']).json()['b_sha256']}"
    assert http.get(b_url, headers=outsider).status_code == 404
    assert http.post(f"/v1/cohorts/{cohort['cohort']}/leave", headers=cohort["users"]["b"]).status_code == 200
    assert http.get(url, headers=cohort["devices"]["b"]["headers"]).status_code == 404  # b left: as the registry
    assert http.get(b_url, headers=cohort["devices"]["b"]["headers"]).status_code == 404
