"""The daemon loop against a mocked server: leftover jobs first, a server that is down is waited out, the stop
event ends it."""

from __future__ import annotations

import io
import json
import random
import threading
from pathlib import Path

import httpx
import numpy as np

from device_agent import api
from device_agent.daemon import RETRY_AFTER_SPREAD, RunOptions, idle_wait, serve
from device_agent.events import Reporter
from device_agent.job import AgentContext
from shared.retry import Backoff
from tests.device_agent.test_job import FILES, LEASE, NoBackend, trained_job


def agent(tmp_path: Path, handler) -> tuple[AgentContext, io.StringIO]:
    http = api.client("http://server", "token", transport=httpx.MockTransport(handler))
    out = io.StringIO()
    ctx = AgentContext(
        api.DeviceAPI(http),
        NoBackend(),
        tmp_path / "work",
        tmp_path / "data",
        Reporter(out, tty=False),
        backoff=Backoff(base=0.01, cap=0.01),
    )
    return ctx, out


def test_leftover_jobs_are_resumed_if_still_ours_and_forgotten_if_not(tmp_path: Path) -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        calls.append(path)
        if path == "/v1/work/job-6/heartbeat":
            return httpx.Response(409, json={"detail": "this device does not hold its lease"})
        if path.endswith("/heartbeat"):
            running = {"cancelled": False, "status": "running", "expires_at": "2030-01-01T00:00:00Z"}
            return httpx.Response(200, json=running)
        if path.endswith("/result"):
            return httpx.Response(201, json={"adapter_id": 1, "version": 1})
        return httpx.Response(200, content=FILES[path.rsplit("/", 1)[-1]])

    ctx, _ = agent(tmp_path, handler)
    trained_job(ctx)  # job 5, waiting to upload
    ctx.job_dir(6).save_lease(LEASE.model_copy(update={"job_id": 6}))
    ctx.job_dir(5).save_lease(LEASE)
    assert serve(ctx, RunOptions(once=True)) == 0
    assert "/v1/work/job-5/result" in calls and "/v1/leases" not in calls  # the leftover job was the one job
    assert not ctx.job_dir(5).root.exists() and not ctx.job_dir(6).root.exists()


def test_a_server_that_is_down_is_waited_out_until_stopped(tmp_path: Path) -> None:
    leases = []

    def handler(request: httpx.Request) -> httpx.Response:
        leases.append(json.loads(request.content))
        if len(leases) <= 3:
            raise httpx.ConnectError("connection refused")
        ctx.stop.set()  # the next wait ends at once
        return httpx.Response(204)

    ctx, out = agent(tmp_path, handler)
    assert serve(ctx, RunOptions(poll_s=60)) == 0
    assert len(leases) == 4 and leases[0]["backend"] == "executorch" and leases[0]["memory_mb"] > 0
    assert [json.loads(line)["event"] for line in out.getvalue().splitlines()] == ["retry"] * 3 + ["stopped"]


class RecordedWaits(threading.Event):
    """The agent's stop event, recording how long each wait between lease requests asked for (and not waiting)."""

    def __init__(self, stop_after: int) -> None:
        super().__init__()
        self.timeouts: list[float | None] = []
        self.stop_after = stop_after

    def wait(self, timeout: float | None = None) -> bool:
        self.timeouts.append(timeout)
        if len(self.timeouts) >= self.stop_after:
            self.set()
        return self.is_set()


def test_an_idle_agent_waits_the_longer_of_its_interval_and_the_servers_retry_after(tmp_path: Path) -> None:
    answers = iter([{"Retry-After": "30"}, {}, {"Retry-After": "2"}])

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(204, headers=next(answers))

    ctx, _ = agent(tmp_path, handler)
    ctx.stop = RecordedWaits(stop_after=3)
    assert serve(ctx, RunOptions(poll_s=5)) == 0
    stretched, *rest = ctx.stop.timeouts
    assert 30 <= stretched <= 30 * (1 + RETRY_AFTER_SPREAD) and rest == [5, 5]  # 2 s stretched stays under 5


def test_the_servers_wait_is_stretched_over_half_again_never_shortened() -> None:
    """A fleet told the same Retry-After at once comes back spread over [R, 1.5 R], not in one burst."""
    rng = random.Random(0)
    waits = [idle_wait(5, 60, rng) for _ in range(2000)]
    assert min(waits) >= 60 and max(waits) <= 60 * (1 + RETRY_AFTER_SPREAD)
    counts, _ = np.histogram(waits, bins=5, range=(60, 90))
    assert counts.min() >= 300  # each fifth of the spread gets its share (400 expected in each)
    assert idle_wait(5, 0, rng) == 5 and idle_wait(5, 3, rng) >= 5
