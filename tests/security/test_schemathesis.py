"""schemathesis against the live server's ``/openapi.json``, once per kind of caller: no server error, no status the
schema does not document, 405s with a correct Allow header. Fixed seed, bounded examples (MAX_EXAMPLES per
operation, besides the coverage phase's); the compile queue is paused, so the jobs it submits stay queued instead of
each starting an export."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.security.conftest import on_both_databases
from tests.server.factories import ADMIN_TOKEN

pytest.importorskip("schemathesis", reason="schemathesis is in the dev extra")

CHECKS = "not_a_server_error,status_code_conformance,unsupported_method,allow_header_conformance"
MAX_EXAMPLES = 10
SEED = 1
# PostgreSQL differs from SQLite in what a column holds (no NUL in text, varchar lengths and integer ranges enforced),
# which the examples and the coverage phase's boundary values reach; its random fuzzing phase is SQLite's alone.
PHASES = {"sqlite": "examples,coverage,fuzzing", "postgresql": "examples,coverage"}


@on_both_databases
@pytest.mark.parametrize("caller", ["admin", "user", "device"])
def test_schemathesis_finds_no_server_error_and_no_undocumented_status(request, live, people, caller, tmp_path):
    database = request.node.callspec.params["live"]
    token = {
        "admin": ADMIN_TOKEN,
        "user": people["user"]["Authorization"].removeprefix("Bearer "),
        "device": people["device"]["headers"]["Authorization"].removeprefix("Bearer "),
    }[caller]
    command = [
        *(sys.executable, "-m", "schemathesis.cli", "run", f"{live.url}/openapi.json"),
        *("--checks", CHECKS, "--max-examples", str(MAX_EXAMPLES), "--seed", str(SEED), "--workers", "1"),
        *("--phases", PHASES[database], "--header", f"Authorization: Bearer {token}"),
    ]
    run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    jobs = people["client"].get("/v1/jobs", params={"limit": 1000}, headers=people["user"]).json()["data"]
    assert {job["status"] for job in jobs} <= {"queued", "cancelled"}  # nothing was compiled


def _fuzz_upload(url: str, route: str, parameters: dict[str, str], authorization: str, tmp_path) -> list[dict]:
    """schemathesis over one upload route with its path parameters fixed (the caller's lease) → the answers it got
    (a HAR log's entries), after asserting it found no server error and no undocumented status."""
    import json

    config = tmp_path / "schemathesis.toml"
    fixed = ", ".join(f"{name} = {json.dumps(value)}" for name, value in parameters.items())
    config.write_text(f'[[operations]]\ninclude-path = "{route}"\nparameters = {{ {fixed} }}\n')
    har = tmp_path / "upload.har"
    command = [
        *(sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run", f"{url}/openapi.json"),
        *("--include-path", route, "--checks", CHECKS, "--max-examples", str(MAX_EXAMPLES)),
        *("--seed", str(SEED), "--workers", "1", "--phases", "examples,coverage,fuzzing"),
        *("--header", f"Authorization: {authorization}", "--report", "har", "--report-har-path", str(har)),
    ]
    run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    entries = json.loads(har.read_text())["log"]["entries"]
    concrete = route.format(**parameters)
    assert entries and all(e["request"]["url"].endswith(concrete) for e in entries)
    return entries


def _read_parts(entries: list[dict]) -> bool:
    """Some answer is a 422 about the request's body: the upload got past the token and lease checks to its parts."""
    return any(e["response"]["status"] == 422 and '"body"' in e["response"]["content"].get("text", "") for e in entries)


def test_schemathesis_over_the_upload_route_of_a_leased_job(world, tmp_path):
    """The personal upload route with its job leased to the caller (``world``'s phone), so that what schemathesis
    sends reaches the parts' checks and the replay rather than stopping at the lease: no server error, no status the
    schema does not document, and the recorded answers show the parts were read (422s naming a part)."""
    from server.limits import WORK_UPLOAD

    headers = world["phone"]["headers"]
    entries = _fuzz_upload(
        world["url"], WORK_UPLOAD, {"work": f"job-{world['job']['id']}"}, headers["Authorization"], tmp_path
    )
    assert _read_parts(entries), sorted({e["response"]["status"] for e in entries})


def test_schemathesis_over_the_upload_route_of_a_leased_round_part(tmp_path):
    """The same for a federated round part leased to the caller (a cohort member's device, a round of K = 1)."""
    from server.limits import WORK_UPLOAD
    from server.settings import Settings
    from tests.security.servers import app_server
    from tests.server.factories import (
        ADMIN,
        FakeCompileQueue,
        create_user,
        enroll_device,
        make_fake_model,
        register_model,
    )

    settings = Settings(
        data_dir=tmp_path / "data", database_url=f"sqlite:///{tmp_path / 'db'}", admin_token=ADMIN_TOKEN
    )
    with app_server(settings, FakeCompileQueue()) as (url, _), httpx.Client(base_url=url, timeout=60) as http:
        register_model(http, make_fake_model(tmp_path / "model"))
        user = create_user(http, "member")
        device = enroll_device(http, user, "phone")
        cohort = http.post("/v1/cohorts", json={"name": "c", "model": "tiny", "task": "sst2"}, headers=ADMIN).json()
        assert http.post(f"/v1/cohorts/{cohort['id']}/join", headers=user).status_code == 200
        spec = {"q": 1, "batch_size": 2, "steps": 5, "rank": 2, "rounds": 1, "clients_per_round": 1}
        assert http.post(f"/v1/cohorts/{cohort['id']}/jobs", json=spec, headers=ADMIN).status_code == 202
        lease = http.post("/v1/leases", json={"eligible": True}, headers=device["headers"]).json()
        client_id = lease["round"]["client_id"]
        entries = _fuzz_upload(
            url, WORK_UPLOAD, {"work": f"part-{client_id}"}, device["headers"]["Authorization"], tmp_path
        )
        assert _read_parts(entries), sorted({e["response"]["status"] for e in entries})
