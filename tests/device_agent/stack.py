"""A real mobizo stack on loopback for the agent's end-to-end tests: a server process (``tests.server.live``),
its admin and a user, and ``mobizo agent`` processes started the way a device starts them."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
import uuid
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.server.factories import ADMIN_TOKEN, bearer
from tests.server.live import REPO
from tests.utils.programs import TINY_Q4_JOB

# Every job has the program config TINY_Q4 (q=4, E=2, 16 columns, SST-2 trained as classification), the suite's
# shared program.
# no held-out measurement (its own test asks for one): the agent loads no evaluator
SPEC = {**TINY_Q4_JOB, "eval_examples": 0}
AGENT_FLAGS = ["--checkpoint-every", "7", "--heartbeat-s", "0.5", "--poll-s", "0.2", "--retry-cap-s", "1"]


def server_env(artifacts: Path, db: Path) -> dict[str, str]:
    return {
        "MOBIZO_DATA_DIR": str(artifacts),
        "MOBIZO_ADMIN_TOKEN": ADMIN_TOKEN,
        "MOBIZO_LEASE_S": "60",
        "DATABASE_URL": f"sqlite:///{db}",
    }


def ok(response: httpx.Response, code: int = 200) -> Any:
    assert response.status_code == code, response.text
    return response.json() if response.content else None


def wait_for(condition: Callable[[], Any], timeout: float, what: str, every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@dataclass
class Stack:
    url: str
    artifacts: Path
    tmp: Path
    model_dir: Path
    user: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        """A new user on the server, which gets the model ``tiny`` unless it has it: many tests share one server
        (the ``live_stack`` fixture), each as a user of its own, who sees only their own jobs and devices."""
        admin = httpx.Client(base_url=self.url, headers=bearer(ADMIN_TOKEN), timeout=60)
        registered = admin.post("/v1/models", json={"name": "tiny", "path": str(self.model_dir)})
        assert registered.status_code in (201, 409), registered.text  # 409: registered for an earlier test
        key = ok(admin.post("/v1/users", json={"name": f"user-{uuid.uuid4().hex[:8]}"}), 201)["api_key"]
        self.user = httpx.Client(base_url=self.url, headers=bearer(key), timeout=60)

    def submit(self, steps: int, **overrides: Any) -> int:
        job = ok(self.user.post("/v1/jobs", json={**SPEC, "steps": steps, **overrides}), 202)
        # compiled: "ready", or already further along when a running agent leased it at once (a warm agent can take
        # a job from ready to succeeded between two polls)
        compiled = self.wait_job(job["id"], {"ready", "running", "succeeded", "failed", "cancelled"}, timeout=600)
        assert compiled["status"] in {"ready", "running", "succeeded"}, compiled["error"]
        return job["id"]

    def job(self, job_id: int) -> dict:
        return ok(self.user.get(f"/v1/jobs/{job_id}"))

    def wait_job(self, job_id: int, statuses: set[str], timeout: float = 120) -> dict:
        return wait_for(lambda: (j := self.job(job_id))["status"] in statuses and j, timeout, f"job {statuses}")

    def enroll(self, backend: str = "executorch", env: dict[str, str] | None = None) -> Path:
        code = ok(self.user.post("/v1/enrollment-codes", json={}), 201)["code"]
        config = self.tmp / f"agent-{code}.json"
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "mobizo",
                "agent",
                "enroll",
                "--server",
                self.url,
                "--backend",
                backend,
                "--name",
                f"test-{backend}",
                "--config",
                str(config),
            ],
            input=f"{code}\n",  # on standard input, as a careful user gives it: not in the process list
            env=agent_env(env),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        return config

    def adapter(self, job_id: int) -> dict:
        adapter_id = self.job(job_id)["adapter_id"]
        return ok(self.user.get(f"/v1/adapters/{adapter_id}"))

    def download_adapter(self, job_id: int, dest: Path) -> Path:
        archive = self.user.get(f"/v1/adapters/{self.adapter(job_id)['id']}/download").raise_for_status().content
        with zipfile.ZipFile(io.BytesIO(archive)) as zf:
            zf.extractall(dest)
        return dest

    def uploaded_log(self, job_id: int) -> Path:
        """The training log the server received (stored by content; the device names its hash in metrics)."""
        return self.artifacts / "logs" / f"{self.adapter(job_id)['metrics']['log_sha256']}.jsonl"


def agent_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), **(extra or {})}


@dataclass
class Agent:
    """``mobizo agent run`` as a process; its structured log lines go to ``log``."""

    config: Path
    work: Path
    data: Path
    log: Path
    extra: list[str] = field(default_factory=list)
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = None

    def start(self, once: bool = True) -> Agent:
        args = [
            sys.executable,
            "-m",
            "mobizo",
            "agent",
            "run",
            "--config",
            str(self.config),
            "--data-dir",
            str(self.data),
            "--work-dir",
            str(self.work),
            *AGENT_FLAGS,
            *self.extra,
            *(["--once"] if once else []),
        ]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, env=agent_env(self.env), stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        return self

    def wait(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"agent still running after {timeout} s:\n{self.tail()}") from None

    def events(self) -> list[dict]:
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return [json.loads(line) for line in lines if line.startswith('{"ts"')]

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def steps_logged(self, job_id: int) -> int:
        path = self.work / "jobs" / str(job_id) / "train_log.jsonl"
        return path.read_text().count("\n") if path.exists() else 0

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def make_agent(stack: Stack, local_data: Path, name: str, backend: str = "executorch", extra=(), env=None) -> Agent:
    """A device of the stack's user, enrolled now, whose agent works under ``stack.tmp``."""
    config = stack.enroll(backend, env)
    return Agent(config, stack.tmp / f"work-{name}", local_data, stack.tmp / f"agent-{name}.log", list(extra), env)
