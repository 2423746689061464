"""The device side on an emulated arm64 device, installed as a user installs it: a Debian arm64 root whose Python
runs under qemu-user (``scripts/arm64_device.sh``), ``mobizo[device]`` installed into it from aarch64 wheels (no
torch, no executorch, no server stack), the self-contained aarch64 runner bundle. Its agent enrolls with the x86
server over loopback, leases a job of the tiny model, trains it with the native backend and uploads: the server
accepts it bit for bit, and the device's held-out points are reported (through the runner's evaluate mode)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.device_agent.stack import AGENT_FLAGS, Stack, ok
from tests.device_agent.test_agent_e2e import assert_adapter_is_replay_of_uploaded_log

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "arm64_device.sh"
HEAVY = ("torch", "executorch", "transformers", "fastapi", "sqlalchemy", "celery")


@pytest.fixture(scope="session")
def arm64_root() -> Path:
    """The emulated device's root, with this checkout's mobizo[device] installed (built once, then cached)."""
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return Path(done.stdout.strip().splitlines()[-1])


def on_arm64(*command: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``command`` on the emulated device (MOBIZO_* variables of ``env`` pass in)."""
    return subprocess.run(
        ["bash", str(SCRIPT), "run", *command],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_arm64_device_install_has_no_torch(arm64_root: Path) -> None:
    code = (
        "import json, platform, importlib.metadata as m; "
        "print(json.dumps([platform.machine(), sorted(d.metadata['Name'].lower() for d in m.distributions())]))"
    )
    done = on_arm64("/opt/mobizo/bin/python", "-c", code)
    assert done.returncode == 0, done.stderr
    machine, names = json.loads(done.stdout)
    assert machine == "aarch64"
    assert {"mobizo", "numpy", "tokenizers", "httpx", "pydantic"} <= set(names)
    assert not set(names) & {*HEAVY, "peft", "uvicorn"}
    help_done = on_arm64("mobizo", "agent", "run", "--help")
    assert help_done.returncode == 0 and "--backend" in help_done.stdout, help_done.stderr
    server = on_arm64("mobizo", "server")
    assert server.returncode == 2 and server.stderr.strip().endswith("pip install 'mobizo[server]'"), server.stderr


def test_arm64_device_trains_a_job_with_the_native_runner_accepted_bit_for_bit(
    arm64_root: Path, runner_bundle_aarch64: Path, stack: Stack, local_data: Path, tmp_path: Path
) -> None:
    home = Path("/root") / f"mobizo-test-{uuid.uuid4().hex[:8]}"  # the device's folder, seen from inside
    inside = arm64_root / home.relative_to("/")
    try:
        shutil.copytree(local_data, inside / "data")
        shutil.copytree(runner_bundle_aarch64, inside / "runner")
        code = ok(stack.user.post("/v1/enrollment-codes", json={}), 201)["code"]
        config = str(home / "agent.json")
        enrolled = on_arm64(
            "mobizo", "agent", "enroll", "--server", stack.url, "--backend", "native", "--name", "arm64-board",
            "--config", config, env={"MOBIZO_ENROLLMENT_CODE": code},
        )  # fmt: skip
        assert enrolled.returncode == 0, enrolled.stderr
        job_id = stack.submit(steps=12, eval_examples=8)
        agent = on_arm64(
            "mobizo", "agent", "run", "--once", "--config", config, "--data-dir", str(home / "data"),
            "--work-dir", str(home / "work"), "--runner", str(home / "runner" / "mobizo_runner"), "--no-policy",
            *AGENT_FLAGS, timeout=900,
        )  # fmt: skip
        assert agent.returncode == 0, (agent.stdout[-3000:], agent.stderr[-3000:])
    finally:
        shutil.rmtree(inside, ignore_errors=True)

    (device,) = ok(stack.user.get("/v1/devices"))["data"]
    assert device["backend"] == "native" and device["cpu"]["arch"] == "aarch64"
    job = stack.job(job_id)
    assert job["status"] == "succeeded", job["error"]
    metrics = stack.adapter(job_id)["metrics"]
    assert metrics["backend"] == "native" and metrics["server"]["replay_max_abs_diff"] == 0.0
    held_out = job["held_out"]  # measured on the device by the runner's evaluate mode
    assert held_out is not None and held_out["n"] == 8, held_out
    assert (held_out["before"]["step"], held_out["after"]["step"]) == (0, 12)
    assert held_out["before"]["loss"] != held_out["after"]["loss"]
    assert_adapter_is_replay_of_uploaded_log(stack, job_id, tmp_path)
