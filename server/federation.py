"""Federated jobs of a cohort: handing out round work, rebuilding each client's update from its log, closing
rounds.

A round r starts from B_r (a B file in the store). Up to K eligible member devices — at most one per user — lease
it; each trains the job's local steps from B_r with its own seed (``client_seed``) and uploads its log alone. The
server replays the log from B_r in a verify worker (``server.verify.replay_log_only``: the log checks, then the
replay), so each client's B_i is the replay of what it logged. The round closes when K clients reported, or at its
deadline with at least M (fewer: reopened once, then the job fails); closing aggregates the deltas B_i − B_r in
client order (``shared.aggregate``), writes B_{r+1} = B_r + ETA·aggregate (with ``server_momentum`` BETA > 0:
B_r + ETA·m_{r+1}, m_{r+1} = BETA·m_r + aggregate, m kept in the store beside B), packages it as the cohort's next
adapter version, and opens round r+1 from it. Every transition goes through ``server.state``.

Replay proves what a log *means*; it cannot prove that its g were honestly measured on real data. The defences
against a lying client are the log checks (every step, the round's seeds, finite losses, each g what its losses
give), the optional bound on |g| (``max_abs_g``) and a robust aggregation (trimmed mean, median).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import and_, func, or_, select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from server import metrics, privacy, registry
from server.pool import WorkerDied, WorkerPool, WorkTimedOut
from server.settings import Settings
from server.state import closes, jobs, rounds
from server.store import ArtifactStore
from server.tables import CohortMember, Job, LeasingDevice, Model, Program, Round, RoundClient, User, utcnow
from server.verify import b_size, base_of, card_of, package_adapter
from shared.aggregate import next_global_b
from shared.b_file import b_file_bytes, read_b_file
from shared.files import atomic_write_bytes
from shared.schemas import FederationProgress, FederationSpec, JobSpec

log = logging.getLogger(__name__)


def client_seed(job_seed: int, round_index: int, slot: int) -> int:
    """A client's run seed (its step seeds and batch order): distinct per (job seed, round, slot), in [0, 2**31)."""
    digest = hashlib.sha256(f"mobizo-round:{job_seed}:{round_index}:{slot}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def federation(job: Job) -> FederationSpec:
    return FederationSpec.model_validate(job.federation)


def store_b(store: ArtifactStore, b: np.ndarray) -> str:
    """Publish a B file in the store's ``adapters/`` by content → its sha256."""
    tmp = store.tmp_dir()
    try:
        path = tmp / "b_flat.safetensors"
        atomic_write_bytes(path, b_file_bytes(np.asarray(b, dtype=np.float32)))
        return store.keep(path, "adapters", ".safetensors")[1]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _d(session: Session, job: Job) -> int:
    return b_size(session.get_one(Program, job.program_id).manifest)


def _candidates(session: Session, device: LeasingDevice) -> list[Job]:
    """Federated jobs of the cohorts the device's user is in now, that the device fits, oldest first."""
    member_of = select(CohortMember.cohort_id).where(
        CohortMember.user_id == device.user_id, CohortMember.left_at.is_(None)
    )
    return list(
        session.scalars(
            select(Job)
            .where(
                Job.cohort_id.in_(member_of),
                Job.status.in_(("ready", "running")),
                or_(Job.device_backend.is_(None), Job.device_backend == device.backend),
                jobs.fits_memory(device.memory_mb),
            )
            .order_by(Job.id)
        )
    )


def lease_round(
    session: Session, store: ArtifactStore, device: LeasingDevice, lease_s: int, settings: Settings
) -> RoundClient | None:
    """Round work for the device, or None: a part in the open round of the oldest federated job it can join, each
    job tried in one transition (``state.rounds.take_round_part``: a free slot of K, no part of its user's yet, and for
    a private job room in the user's privacy budget, ``server.privacy.claim_part``). Committed."""
    for job in _candidates(session, device):
        fed = federation(job)
        first_b = store_b(store, np.zeros(_d(session, job), np.float32)) if job.status == "ready" else None
        room = None
        if job.private:
            spec = job.spec

            def room(s: Session, spec: dict = spec) -> bool:
                return privacy.claim_part(s, s.get_one(User, device.user_id), settings, spec)

        def seed(index: int, slot: int, job_seed: int = job.spec["seed"]) -> int:
            return client_seed(job_seed, index, slot)

        part = rounds.RoundPart(fed.clients_per_round, fed.round_timeout_s, lease_s, seed, room, fed.in_flight)
        client = rounds.take_round_part(session, job, device, part, first_b)
        if client is not None:
            return client
    return None


def client_spec(job: Job, client: RoundClient) -> JobSpec:
    """What the client trains: the job's spec with the client's seed, log-only upload."""
    return jobs.device_spec(job).model_copy(update={"seed": client.seed, "upload": "log"})


def replay_context(session: Session, job: Job, client: RoundClient) -> dict[str, Any]:
    """What ``server.verify.replay_log_only`` needs to check and replay a client's log (plain data)."""
    program = session.get_one(Program, job.program_id)
    return {
        "spec": client_spec(job, client).model_dump(mode="json"),
        "d": b_size(program.manifest),
        "max_abs_g": federation(job).max_abs_g,
    }


def _package_context(session: Session, job: Job) -> dict[str, Any]:
    program = session.get_one(Program, job.program_id)
    return {
        "manifest": program.manifest,
        "d": b_size(program.manifest),
        **base_of(session.get_one(Model, job.model_id)),
        "card": card_of(job, program.manifest),
    }


def reported_clients(session: Session, round_id: int) -> list[RoundClient]:
    """The round's reported clients in aggregation order: the order they were leased (client id)."""
    return list(
        session.scalars(
            select(RoundClient)
            .where(RoundClient.round_id == round_id, RoundClient.status == "reported")
            .order_by(RoundClient.id)
            .execution_options(populate_existing=True)  # reported by conditional UPDATEs: reload the rows
        )
    )


def pending_parts(session: Session, job: Job, round_: Round) -> list[RoundClient]:
    """The reports the close of ``round_`` aggregates, in aggregation order (client id): its own reported clients;
    for a buffered job, every report no close has counted yet of its rounds within ``max_staleness`` of ``round_``
    (one that arrived while the version it counted towards was closing, and is too old for the next, is left out:
    wasted, as a late synchronous report is)."""
    if not rounds.buffered(job.federation):
        return reported_clients(session, round_.id)
    oldest = round_.index - job.federation["max_staleness"]
    return list(
        session.scalars(
            select(RoundClient)
            .join(Round, Round.id == RoundClient.round_id)
            .where(
                Round.job_id == job.id,
                Round.index >= oldest,
                RoundClient.status == "reported",
                RoundClient.counted_in_round_id.is_(None),
            )
            .order_by(RoundClient.id)
            .execution_options(populate_existing=True)
        )
    )


def open_round_of(session: Session, job: Job) -> Round | None:
    """The job's open round (read, not locked), if any."""
    return session.scalars(select(Round).where(Round.job_id == job.id, Round.status == "open")).first()


def part_is_open(session: Session, client: RoundClient, round_: Round, job: Job) -> bool:
    """``state.rounds.client_is_open`` with the job's newest round read for a buffered job."""
    newest = session.scalar(select(func.max(Round.index)).where(Round.job_id == job.id)) or 0
    return rounds.client_is_open(client, round_, job.federation, newest)


def _round_record(
    job: Job,
    round_: Round,
    fed: FederationSpec,
    clients: list[RoundClient],
    started: dict[int, Round],
    b_next: str,
    m_next: str | None,
) -> bytes:
    """The round's account (stored with the adapter as its "log"): everything an offline recomputation needs."""
    record = {
        "job_id": job.id,
        "cohort_id": job.cohort_id,
        "round": round_.index,
        "b_r_sha256": round_.b_sha256,
        "aggregation": fed.aggregation,
        "trim_fraction": fed.trim_fraction,
        "global_lr": fed.global_lr,
        "server_momentum": fed.server_momentum,
        "m_r_sha256": round_.momentum_sha256,
        "m_next_sha256": m_next,
        "mode": fed.mode,
        "clients": [
            {
                "id": c.id,
                "seed": c.seed,
                "log_sha256": c.log_sha256,
                "b_sha256": c.b_sha256,
                "round": started[c.id].index,
                "b_start_sha256": started[c.id].b_sha256,
                "staleness": round_.index - started[c.id].index,
            }
            for c in clients
        ],
        "b_next_sha256": b_next,
    }
    return json.dumps(record, indent=2, sort_keys=True).encode()


def close_round(session: Session, store: ArtifactStore, pool: WorkerPool, settings: Settings, round_id: int) -> bool:
    """Aggregate a round and publish B_{r+1} as the cohort's next adapter version; False if another request or
    sweep is closing it. A passing failure (the packaging worker died or timed out, the database hiccuped) leaves
    the round open for the sweeper to close again; any other fails the round and the job with the reason."""
    closing_at = closes.begin_close(session, round_id)
    if closing_at is None:
        return False
    round_ = session.get_one(Round, round_id, populate_existing=True)
    job = session.get_one(Job, round_.job_id)
    try:
        for staleness in _aggregate_and_publish(session, store, pool, settings, job, round_, closing_at):
            metrics.PART_STALENESS.observe(staleness)
        metrics.ROUND_CLOSES.labels("closed").inc()
    except closes.CloseTakenOver as error:
        log.warning("%s; this close publishes nothing", error)
    except (WorkerDied, WorkTimedOut, OperationalError) as error:
        metrics.ROUND_CLOSES.labels("retried").inc()
        log.warning("closing round %d of job %d stopped (%s); it will be closed again", round_.index, job.id, error)
        closes.retry_close(session, round_, closing_at)
    except Exception as error:  # noqa: BLE001 - whatever broke, the round must not stay "closing" silently
        metrics.ROUND_CLOSES.labels("failed").inc()
        log.exception("closing round %d of job %d failed", round_.index, job.id)
        closes.abort_close(session, round_, closing_at, f"aggregation failed: {type(error).__name__}: {error}")
    return True


def _aggregate_and_publish(
    session: Session,
    store: ArtifactStore,
    pool: WorkerPool,
    settings: Settings,
    job: Job,
    round_: Round,
    closing_at: datetime,
) -> list[int]:
    """Aggregate the parts the close counts and publish the next version → each counted part's staleness."""
    fed, ctx = federation(job), _package_context(session, job)
    clients = pending_parts(session, job, round_)  # read in autocommit: no write lock while aggregating
    started = {c.id: session.get_one(Round, c.round_id) for c in clients}  # the version each part leased
    start = time.perf_counter()
    b_r = read_b_file(store.adapter_b(round_.b_sha256), ctx["d"])
    client_bs = [read_b_file(store.adapter_b(c.b_sha256), ctx["d"]) for c in clients]
    m_r = read_b_file(store.adapter_b(round_.momentum_sha256), ctx["d"]) if round_.momentum_sha256 else None
    aggregated = (fed.aggregation, fed.trim_fraction, fed.global_lr, fed.server_momentum, m_r)
    buffered = {}
    if fed.mode == "buffered":
        starts = [read_b_file(store.adapter_b(started[c.id].b_sha256), ctx["d"]) for c in clients]
        buffered = {"starts": starts, "staleness": [round_.index - started[c.id].index for c in clients]}
    b_next, m_next = next_global_b(b_r, client_bs, *aggregated, **buffered)
    aggregate_s = time.perf_counter() - start
    b_next_sha = store_b(store, b_next)
    m_next_sha = store_b(store, m_next) if fed.server_momentum else None
    tmp = store.tmp_dir()
    try:
        archive = Path(pool.run(package_adapter, ctx, str(store.adapter_b(b_next_sha)), str(tmp)))
        archive_sha = store.keep(archive, "archives", ".zip")[1]
        record = tmp / "round.json"
        atomic_write_bytes(record, _round_record(job, round_, fed, clients, started, b_next_sha, m_next_sha))
        record_sha = store.keep(record, "rounds", ".json")[1]
        archive_size = store.archive(archive_sha).stat().st_size
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    losses = [c.mean_loss for c in clients if c.mean_loss is not None]  # private parts report none
    mean_loss = float(np.mean(losses)) if losses else None
    metrics = {
        "round": round_.index,
        "clients": len(clients),
        "mean_loss": mean_loss,
        "aggregation": fed.aggregation,
        "aggregate_s": aggregate_s,
        "replay_s": [c.replay_s for c in clients],
    }
    files = registry.StoredFiles(b_next_sha, b_next_sha, record_sha, archive_sha, archive_size)
    closes.finish_close(session, round_, closing_at, files, metrics, [c.id for c in clients], m_next_sha)
    return [round_.index - started[c.id].index for c in clients]


def is_full(session: Session, client: RoundClient) -> bool:
    """After a report: whether the job's open round has K reports waiting for it (``pending_parts``), so that the
    sweeper should close it now."""
    job = session.get_one(Job, session.get_one(Round, client.round_id).job_id)
    round_ = open_round_of(session, job)
    return round_ is not None and len(pending_parts(session, job, round_)) >= federation(job).clients_per_round


CLOSE_MARGIN_S = 300


def stale_close_after(settings: Settings) -> timedelta:
    """How long a close may take: its packaging task's timeout, plus a margin for reading and storing the files
    (an object store upload included)."""
    return timedelta(seconds=settings.verify_timeout_s + CLOSE_MARGIN_S)


def sweep(session: Session, store: ArtifactStore, pool: WorkerPool, settings: Settings) -> None:
    """Free the slots of clients whose lease ran out; reopen a close older than any close may take (its process
    died); close an open round that is full (K reports: one whose closing was stopped, or left by a stopped
    server); at each open round's deadline close it with at least M reports, else reopen it once, else fail it
    (and its job) with the reason."""
    rounds.sweep_round_clients(session)
    stale = closes.reopen_stale_closes(session, stale_close_after(settings))
    if stale:
        log.warning("%d rounds left mid-close (a stopped API process) will be closed again", stale)
    for round_ in list(session.scalars(select(Round).where(Round.status == "open"))):
        job = session.get_one(Job, round_.job_id)
        full = len(pending_parts(session, job, round_)) >= federation(job).clients_per_round
        if full:
            close_round(session, store, pool, settings, round_.id)
    due = list(
        session.scalars(
            select(Round).where(
                and_(Round.status == "open", Round.deadline_at.is_not(None), Round.deadline_at < utcnow())
            )
        )
    )
    for round_ in due:
        job = session.get_one(Job, round_.job_id)
        fed = federation(job)
        reported = len(pending_parts(session, job, round_))
        if reported >= fed.min_reports:
            close_round(session, store, pool, settings, round_.id)
        elif not round_.reopened:
            closes.reopen(session, round_, fed.round_timeout_s)
        else:
            closes.fail_round(
                session,
                round_,
                f"{reported} of at least {fed.min_reports} clients reported by the deadline (reopened once)",
            )


def progress(session: Session, job: Job) -> FederationProgress:
    """``mobizo jobs show``: the round in progress, its clients, the last closed round's mean loss."""
    fed = federation(job)
    current = session.scalars(select(Round).where(Round.job_id == job.id).order_by(Round.index.desc())).first()
    last_closed = session.scalars(
        select(Round).where(Round.job_id == job.id, Round.status == "closed").order_by(Round.index.desc())
    ).first()
    counts = {}
    if current is not None:
        rows = session.execute(
            select(RoundClient.status, func.count(RoundClient.id))
            .where(RoundClient.round_id == current.id)
            .group_by(RoundClient.status)
        ).all()
        counts = dict(rows)
    return FederationProgress(
        round=None if current is None else current.index,
        rounds=fed.rounds,
        clients_leased=counts.get("leased", 0),
        clients_reported=counts.get("reported", 0),
        last_mean_loss=None if last_closed is None else last_closed.mean_loss,
    )
