"""schemathesis against the live server's ``/openapi.json``, once per kind of caller: no server error, no status
the schema does not document, 405s with a correct Allow header. Fixed seed, bounded examples (about a minute in
all); the compile queue is paused, so the jobs it submits stay queued instead of each starting an export."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.server.factories import ADMIN_TOKEN

pytest.importorskip("schemathesis", reason="schemathesis is in the dev extra")

CHECKS = "not_a_server_error,status_code_conformance,unsupported_method,allow_header_conformance"
MAX_EXAMPLES = 50
SEED = 1


@pytest.mark.parametrize("caller", ["admin", "user", "device"])
def test_schemathesis_finds_no_server_error_and_no_undocumented_status(live, people, caller, tmp_path):
    token = {
        "admin": ADMIN_TOKEN,
        "user": people["user"]["Authorization"].removeprefix("Bearer "),
        "device": people["device"]["headers"]["Authorization"].removeprefix("Bearer "),
    }[caller]
    command = [
        *(sys.executable, "-m", "schemathesis.cli", "run", f"{live.url}/openapi.json"),
        *("--checks", CHECKS, "--max-examples", str(MAX_EXAMPLES), "--seed", str(SEED), "--workers", "1"),
        *("--phases", "examples,coverage,fuzzing", "--header", f"Authorization: Bearer {token}"),
    ]
    run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    jobs = people["client"].get("/v1/jobs", params={"limit": 1000}, headers=people["user"]).json()["data"]
    assert {job["status"] for job in jobs} <= {"queued", "cancelled"}  # nothing was compiled


def test_schemathesis_over_the_upload_route_of_a_leased_job(world, tmp_path):
    """The personal upload route with its job leased to the caller (``world``'s phone), so that what schemathesis
    sends reaches the parts' checks and the replay rather than stopping at the lease: no server error, no status the
    schema does not document, and the recorded answers show the parts were read (422s naming a part)."""
    import json

    from server.limits import RESULT_UPLOAD

    config = tmp_path / "schemathesis.toml"
    config.write_text(
        f'[[operations]]\ninclude-path = "{RESULT_UPLOAD}"\nparameters = {{ job_id = {world["job"]["id"]} }}\n'
    )
    har = tmp_path / "upload.har"
    command = [
        *(
            sys.executable,
            "-m",
            "schemathesis.cli",
            "--config-file",
            str(config),
            "run",
            f"{world['url']}/openapi.json",
        ),
        *("--include-path", RESULT_UPLOAD, "--checks", CHECKS, "--max-examples", str(MAX_EXAMPLES)),
        *("--seed", str(SEED), "--workers", "1", "--phases", "examples,coverage,fuzzing"),
        *("--header", f"Authorization: {world['phone']['headers']['Authorization']}"),
        *("--report", "har", "--report-har-path", str(har)),
    ]
    run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    entries = json.loads(har.read_text())["log"]["entries"]
    urls = {entry["request"]["url"] for entry in entries}
    assert urls and all(url.endswith(f"/v1/jobs/{world['job']['id']}/result") for url in urls)
    parts = [
        e for e in entries if e["response"]["status"] == 422 and '"body"' in e["response"]["content"].get("text", "")
    ]
    assert parts, sorted({e["response"]["status"] for e in entries})
