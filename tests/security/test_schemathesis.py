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
