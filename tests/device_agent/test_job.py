"""A job's life on the device against a mocked server (``httpx.MockTransport``): what ends it, and what its folder
keeps. The full path with a real server is in ``test_agent_e2e.py``."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import httpx
import pytest

from device_agent import api
from device_agent.backends.local import LocalBackend
from device_agent.eligibility import Eligibility, Policy, Readings
from device_agent.events import Reporter
from device_agent.heartbeat import Heartbeat
from device_agent.job import AgentContext, pause, run_job
from shared.retry import Backoff
from shared.schemas import FileRef, JobSpec, LeasePublic, RoundLeasePublic
from tests.utils.manifests import fake_manifest

FILES = {"program": b"pte bytes", "weights": b"ptd bytes" * 100, "tokenizer": b"{}"}
MANIFEST = fake_manifest(
    {"q": 1, "batch_size": 2, "seq_len": 16, "answer_len": 1},
    {
        "pte": {"file": "program.pte", "size": 9, "sha256": "0" * 64},
        "ptd": {"file": "weights.ptd", "size": 900, "sha256": "1" * 64},
        "tokenizer": {"file": "tokenizer.json", "size": 2, "sha256": "2" * 64},
    },
    lora_size=4,
)


def ref(name: str) -> FileRef:
    data = FILES[name]
    return FileRef(url=f"/v1/jobs/5/{name}", size=len(data), sha256=hashlib.sha256(data).hexdigest())


LEASE = LeasePublic(
    job_id=5,
    attempt=1,
    manifest=MANIFEST,
    program=ref("program"),
    weights=ref("weights"),
    tokenizer=ref("tokenizer"),
    spec=JobSpec(task="sst2", q=1, batch_size=2, seq_len=16, answer_len=1, steps=3),
    expires_at="2030-01-01T00:00:00Z",
    heartbeat_s=60,
)
PART_LEASE = LEASE.model_copy(
    update={
        "spec": LEASE.spec.model_copy(update={"upload": "log"}),
        "round": RoundLeasePublic(client_id=7, index=0, deadline_at=None),
    }
)


class Server:
    """Serves the job's files; answers heartbeats and results as told; records what it was sent."""

    def __init__(self, result_status: int = 201, cancelled: bool = False, unavailable: int = 0) -> None:
        """``unavailable``: answer that many result uploads with 503 first."""
        self.result_status, self.cancelled, self.unavailable, self.calls = result_status, cancelled, unavailable, []
        self.failure = ""

    def __call__(self, request: httpx.Request) -> httpx.Response:
        name = request.url.path.rsplit("/", 1)[-1]
        self.calls.append(name)
        if name in FILES:
            return httpx.Response(200, content=FILES[name])
        if name == "fail":
            self.failure = json.loads(request.content)["error"]
            return httpx.Response(204)
        if name == "heartbeat":
            return httpx.Response(
                200, json={"cancelled": self.cancelled, "status": "running", "expires_at": "2030-01-01T00:00:00Z"}
            )
        if self.calls.count("result") <= self.unavailable:
            return httpx.Response(503, json={"detail": "try later"})
        return httpx.Response(self.result_status, json={"adapter_id": 1, "version": 1, "detail": "job cancelled"})


class NoBackend(LocalBackend):
    """A backend that must not be asked to train (these jobs end before, or are trained already)."""

    def __init__(self) -> None:
        super().__init__("executorch", lambda run: pytest.fail("training was not expected"))


def context(tmp_path: Path, server: Server, backend: NoBackend) -> tuple[AgentContext, io.StringIO]:
    http = api.client("http://server", "token", transport=httpx.MockTransport(server))
    out = io.StringIO()
    ctx = AgentContext(
        api.DeviceAPI(http),
        backend,
        tmp_path / "work",
        tmp_path / "data",
        Reporter(out, tty=False),
        backoff=Backoff(base=0.01, cap=0.01),
    )
    return ctx, out


def events(out: io.StringIO) -> list[str]:
    return [json.loads(line)["event"] for line in out.getvalue().splitlines()]


def test_missing_local_data_fails_the_job_with_the_reason_and_clears_its_folder(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    server = Server()
    ctx, out = context(tmp_path, server, NoBackend())
    assert run_job(ctx, LEASE) == "failed"
    assert "no training data for task 'sst2'" in server.failure
    assert "error" in events(out)
    assert not ctx.job_dir(5).root.exists()
    assert sorted((tmp_path / "work" / "cache").iterdir())  # the downloads stay for the next job


def trained_job(ctx: AgentContext) -> None:
    """A job folder whose training finished before the agent stopped: only the upload is left."""
    jobs = ctx.job_dir(5)
    jobs.root.mkdir(parents=True)
    for path in (jobs.log, jobs.b_flat, jobs.metrics):
        path.write_bytes(b"{}")


def test_a_trained_job_is_uploaded_and_its_folder_cleared(tmp_path: Path) -> None:
    server = Server()
    ctx, out = context(tmp_path, server, NoBackend())
    trained_job(ctx)
    assert run_job(ctx, LEASE) == "succeeded"
    assert server.calls[-1] == "result" and "uploaded" in events(out)
    assert not ctx.job_dir(5).root.exists()


@pytest.mark.parametrize("cancelled, state", [(True, "cancelled"), (False, "lost")])
def test_a_refused_upload_is_a_cancel_or_a_lost_lease(tmp_path: Path, cancelled: bool, state: str) -> None:
    ctx, _ = context(tmp_path, Server(result_status=409, cancelled=cancelled), NoBackend())
    trained_job(ctx)
    assert run_job(ctx, LEASE) == state
    assert ctx.job_dir(5).root.exists() == (state == "lost")  # a lost job keeps its result: it may come back


def test_server_errors_on_upload_are_retried(tmp_path: Path) -> None:
    server = Server(unavailable=3)
    ctx, out = context(tmp_path, server, NoBackend())
    trained_job(ctx)
    assert run_job(ctx, LEASE) == "succeeded"
    assert server.calls.count("result") == 4 and events(out).count("retry") == 3


@pytest.mark.parametrize("lease, given_back", [(LEASE, False), (PART_LEASE, True)])
def test_work_paused_past_the_limit_is_given_back_only_where_the_device_may_not_resume_it(
    tmp_path: Path, lease: LeasePublic, given_back: bool
) -> None:
    """A round part paused past the device's limit is given up at once (its slot goes to another device); a job's
    lease is left to expire, this device may lease it again and resume from its log."""
    server = Server()
    ctx, out = context(tmp_path, server, NoBackend())
    ctx.eligibility, ctx.pause_limit_s = Eligibility(Policy(), lambda: Readings(charging=False), check_s=0), 0.0
    beat = Heartbeat(ctx.api, lease.job_id, 60, ctx.reporter.event, path=lease.work_path)  # never started
    assert pause(ctx, lease, beat) == "released"
    assert events(out)[-1] == ("error" if given_back else "released")
    assert (server.failure == "paused past the device's limit") == given_back
    assert lease.resumable != given_back
