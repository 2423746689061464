"""The device daemon: lease a job, run it (``device_agent.job``), repeat, until the stop event is set.

On start it first takes up the jobs a previous run left unfinished (stopped, killed, or waiting to upload): one
heartbeat says whether each is still this device's (go on) or not (cancelled, gone, or its lease ran out: forget
it). Every call to the server retries with backoff while the
server is unreachable; every wait ends at once when the stop event is set (SIGTERM, SIGINT).
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from pathlib import Path

import httpx

from device_agent.api import NoWork
from device_agent.heartbeat import Heartbeat
from device_agent.job import ENDED, AgentContext, run_job
from shared.errors import ExitCode, MobizoError
from shared.retry import call_with_retry
from shared.schemas import LeasePublic

POLL_S = 5.0
RETRY_AFTER_SPREAD = 0.5  # a server's Retry-After is stretched by up to this fraction of itself, at random


@dataclass(frozen=True)
class RunOptions:
    once: bool = False  # stop after one job has ended for this device
    poll_s: float = POLL_S  # wait between lease requests when no job is ready


def unfinished(ctx: AgentContext) -> list[LeasePublic]:
    """Leases of the jobs left in the work folder, oldest job first."""
    leases = []
    for path in sorted((ctx.work_dir / "jobs").glob("*/lease.json"), key=_work_order):
        try:
            leases.append(LeasePublic.model_validate_json(path.read_text()))
        except ValueError:
            ctx.reporter.event("discarded", path=str(path.parent), reason="unreadable lease")
            ctx.job_dir(path.parent.name).remove()
    return leases


def _work_order(lease_file: Path) -> tuple[int, str]:
    """Folders are named by ``LeasePublic.work_key``: the job id, then for a round part its round and client."""
    job, _, rest = lease_file.parent.name.partition("-")
    return (int(job) if job.isdigit() else -1, rest)


def still_mine(ctx: AgentContext, lease: LeasePublic) -> bool:
    """Whether a job left from a previous run is still this device's to finish; forgets it when it is not.

    No answer (the server is down) counts as yes: training goes on and the heartbeats will tell.
    """
    jobs = ctx.job_dir(lease.work_key)
    beat = Heartbeat(ctx.api, lease.job_id, 0.0, ctx.reporter.event, jobs.steps_logged(), lease.work_path)
    beat.beat()
    if beat.halted:  # cancelled, gone, or its lease ran out (then it is leased afresh, maybe to another device)
        jobs.remove()
    return not beat.halted


def next_lease(ctx: AgentContext) -> LeasePublic | NoWork:
    """A new job for this device, or ``NoWork`` (with the wait the server asks for); waits out a server that is
    down (until the agent stops). A device whose policy does not hold (not charging, too hot, …) takes no work at
    all."""
    reason = ctx.eligibility.reason()
    if reason is not None:
        ctx.reporter.event("ineligible", reason=reason)
        return NoWork()
    backend, host = ctx.backend, ctx.backend.host
    return call_with_retry(ctx.policy(), ctx.api.lease, backend.name, host.free_memory_mb(), True, host.cpu())


def idle_wait(poll_s: float, retry_after_s: float, rng: random.Random) -> float:
    """How long an idle agent waits before it asks for work again: its own interval, or the server's Retry-After
    stretched by up to ``RETRY_AFTER_SPREAD`` of itself at random, whichever is longer. Devices told the same wait
    at the same moment (a fleet that reconnects together after a server restart) then ask again spread over half
    that wait, not all at once; none asks sooner than the server said."""
    return max(poll_s, retry_after_s * (1 + RETRY_AFTER_SPREAD * rng.random()))


def serve(ctx: AgentContext, options: RunOptions) -> ExitCode:
    """Run jobs until stopped (``options.once``: until one has ended); the exit status of ``mobizo agent run``."""
    for lease in [lease for lease in unfinished(ctx) if still_mine(ctx, lease)]:  # forget the others first
        if ctx.stop.is_set():
            return ExitCode.OK
        state = run_job(ctx, lease)
        if options.once and state in ENDED:
            return ExitCode.OK if state in ("succeeded", "cancelled") else ExitCode.FAILURE
    rng = random.Random()
    while not ctx.stop.is_set():
        try:
            lease = next_lease(ctx)
        except httpx.HTTPError as error:
            if ctx.stop.is_set():
                break
            raise MobizoError(f"cannot lease jobs: {error}") from None
        if isinstance(lease, NoWork):
            ctx.stop.wait(idle_wait(options.poll_s, lease.retry_after_s, rng))
            continue
        state = run_job(ctx, lease)
        if options.once and state in ENDED:
            return ExitCode.OK if state in ("succeeded", "cancelled") else ExitCode.FAILURE
    ctx.reporter.event("stopped")
    return ExitCode.OK


def stop_on_signals(stop: threading.Event) -> None:
    """SIGTERM and SIGINT set ``stop``: the step in progress finishes, is checkpointed, and the agent exits."""
    import signal

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())


def default_work_dir(device_id: int | str) -> Path:
    """Default work folder: ``$XDG_CACHE_HOME/mobizo/agent-<device id>`` (``~/.cache`` without it)."""
    import os

    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "mobizo" / f"agent-{device_id}"
