"""The job state machine: the one module that writes ``Job.status``, as small database transitions shared by the
routes, the compile queue and the lease sweeper (``tests/server/test_structure.py`` keeps it so).

    queued → compiling → ready → running → succeeded
                 ↘ failed       ↑   ↓ ↘ failed (lease expired max_attempts times)
                                └───┘ lease expired: back to ready, attempts counted
    cancelled from any state before succeeded/failed.

A standing job (``standing``) is never leased itself: compiled, it stays ``ready`` — waiting for its next session —
and each time an eligible device of its user asks for work with no session of it in flight, ``lease_session``
creates a session, a job of its own that starts ``running`` under that device's lease from the standing job's
promoted adapter, and then goes the ordinary way (lease expiry, failure, cancel, result). A session's result
(``accept_result``) promotes its version when its held-out loss after is below before (the version it started
from, on the same slice); after ``sessions`` sessions that published a version the standing job succeeds.
Cancelling a standing job cancels its session in flight.

A federated job (``cohort_id`` set) is ``ready`` until its first client leases round 0, then ``running`` through
its rounds, each of which goes

    open → closing → closed (B_{r+1} published; the next round opens, or after the last the job succeeds)
      ↘ reopened once at the timeout with fewer than M reports; at the second timeout: failed (and so is the job)

and each client's part in a round goes leased → reported (its log replayed), or leased → expired (its lease ran
out: the slot is free again). This module writes those statuses too.

Transaction rule (``server.accounts``'s too): a transition is one unit of work, which its function opens
(``server.db.begin_write``: the session's read ends, a write transaction begins) and commits, so a route's write is
all or nothing and nothing else in ``server/`` commits. Where a write depends on what was read (a lease, a round
part), the reads are inside the unit. The few functions that are a step of a larger transaction say "the caller
commits" and join their caller's unit: ``succeed`` in ``accept_result`` (with the adapter version), a lease's
``expire_leases`` before ``lease_next``, the round work of ``take_round_part`` (``open_first_round``,
``lease_round_client``), ``expire_round_clients`` in the sweep, and a compiled program's ``program_row``
(``tests/server/test_structure.py`` holds every writer here to it).

Transitions that race (a heartbeat against the sweeper, a result against a cancel) are conditional UPDATEs
checked by their row count, which is safe on SQLite and on PostgreSQL alike; leasing locks the row it takes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    Boolean,
    Engine,
    Update,
    and_,
    bindparam,
    case,
    delete,
    exists,
    func,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, aliased

from server import accounts, registry
from server.accounts import SeenMemo
from server.db import begin_write
from server.tables import (
    Adapter,
    Device,
    DeviceIdentity,
    Job,
    LeasingDevice,
    MergedFile,
    Model,
    Program,
    Round,
    RoundClient,
    utcnow,
)
from shared.manifest import ProgramManifest
from shared.schemas import TERMINAL_STATUSES, HeartbeatCreate, JobCreate, JobSpec

SUBMIT_ATTEMPTS = 8  # a private submit's tries at claiming its user's privacy ledger against racing ones


def submit(session: Session, charge: Callable[[Session], bool] | None = None, **columns: Any) -> Job | None:
    """A new job (``columns``: the ``Job`` fields but the state), queued for the compile queue. ``charge``: a
    private job's ledger entry (``server.privacy.charge``), run first in the same transaction; it raises to refuse
    the job, and answers False when a racing submit claimed the ledger first: then it runs again on the ledger
    that submit left. None if it lost every try."""
    for _ in range(SUBMIT_ATTEMPTS):
        if charge is None or charge(session):
            begin_write(session)  # joins the charge's unit (its ledger claim) if it opened one
            job = Job(**columns, status="queued")
            session.add(job)
            session.commit()
            return job
        session.rollback()
    return None


def device_spec(job: Job) -> JobSpec:
    """What a device (and the result checks) learn of a job: its task and hyperparameters, ``answer_len`` resolved."""
    fields = JobSpec.model_fields
    spec = {k: v for k, v in JobCreate.model_validate(job.spec).model_dump().items() if k in fields}
    return JobSpec(**{**spec, "answer_len": job.answer_len})


@dataclass(frozen=True)
class CompileInput:
    """What a compile worker needs, detached from the database session."""

    job_id: int
    model_dir: str
    model_sha256: str
    spec: dict[str, Any]


def requeue_unfinished(session: Session) -> list[int]:
    """compiling → queued for jobs a previous run left mid-compile → the ids of every queued job, oldest first."""
    begin_write(session)
    ids = list(session.scalars(select(Job.id).where(Job.status.in_(("queued", "compiling"))).order_by(Job.id)))
    session.execute(update(Job).where(Job.id.in_(ids)).values(status="queued"))
    session.commit()
    return ids


def queued_ids(session: Session) -> list[int]:
    """Ids of the queued jobs, oldest first: what a distributed queue resubmits on start, in case the server
    stopped between committing a job and handing it to the broker (compiling jobs are the broker's to redeliver)."""
    return list(session.scalars(select(Job.id).where(Job.status == "queued").order_by(Job.id)))


def start_compiling(session: Session, job_id: int, resume: bool = False) -> CompileInput | None:
    """queued → compiling; None when the job is gone or no longer queued (cancelled meanwhile).

    ``resume``: also take a job already ``compiling``, for a task the broker redelivered because the worker that
    had it died mid-export (a duplicate delivery that is not a redelivery leaves such a job to its live worker).
    """
    begin_write(session)
    statuses = ("queued", "compiling") if resume else ("queued",)
    moved = session.execute(
        update(Job).where(Job.id == job_id, Job.status.in_(statuses)).values(status="compiling", updated_at=utcnow())
    ).rowcount
    if not moved:
        session.rollback()
        return None
    job = session.get_one(Job, job_id)
    model = session.get_one(Model, job.model_id)
    session.commit()
    return CompileInput(job.id, model.path, model.sha256, dict(job.spec))


def program_row(session: Session, model_id: int, key: str, manifest: dict[str, Any], kind: str = "training") -> Program:
    """The Program row of ``key`` (a training or an inference program), inserted on first sight; flushed (the caller
    commits)."""
    begin_write(session)
    existing = session.scalar(select(Program).where(Program.key == key))
    if existing is not None:
        return existing
    memory_mb = ProgramManifest.model_validate(manifest).memory_mb if kind == "training" else None
    program = Program(
        key=key,
        kind=kind,
        model_id=model_id,
        manifest=manifest,
        memory_mb=memory_mb,
    )
    try:
        with session.begin_nested():
            session.add(program)
    except IntegrityError:  # another job (or process) with the same config got there first
        return session.scalars(select(Program).where(Program.key == key)).one()
    return program


def add_inference_program(session: Session, model_id: int, key: str, manifest: dict[str, Any]) -> None:
    """A built inference program's row (``program_row``), committed: its files are granted to devices."""
    program_row(session, model_id, key, manifest, kind="inference")
    session.commit()


def keep_merged(
    session: Session, key: str, user_id: int, built: dict[str, Any], per_user_bytes: int, total_bytes: int
) -> list[str]:
    """A built merged download's row (``built``: its sha256 and size), counted against ``user_id``, and the rows
    evicted to keep the bounds: least recently used first, the user's own until they hold at most
    ``per_user_bytes``, then anyone's until all hold at most ``total_bytes``; never the new one → the evicted keys,
    whose files the caller removes once this is committed (``server.merged_builds``)."""
    begin_write(session)
    now = utcnow()
    row = session.get(MergedFile, key)
    if row is None:
        session.add(MergedFile(key=key, user_id=user_id, sha256=built["sha256"], size=built["size"], used_at=now))
    else:
        row.user_id, row.sha256, row.size, row.used_at = user_id, built["sha256"], built["size"], now
    session.flush()
    kept = session.execute(
        select(MergedFile.key, MergedFile.user_id, MergedFile.size)
        .order_by(MergedFile.used_at, MergedFile.key)
        .with_for_update()
    ).all()
    evicted: list[str] = []
    for whose, bound in ((user_id, per_user_bytes), (None, total_bytes)):
        held = [r for r in kept if r.key not in evicted and (whose is None or r.user_id == whose)]
        used = sum(r.size for r in held)
        for r in held:
            if used <= bound:
                break
            if r.key != key:
                evicted.append(r.key)
                used -= r.size
    if evicted:
        session.execute(delete(MergedFile).where(MergedFile.key.in_(evicted)))
    session.commit()
    return evicted


def touch_merged(session: Session, key: str) -> None:
    """A merged download served: it is now the most recently used."""
    begin_write(session)
    session.execute(update(MergedFile).where(MergedFile.key == key).values(used_at=utcnow()))
    session.commit()


def forget_merged(session: Session, keys: list[str]) -> None:
    """Merged downloads whose files are gone (removed by hand, or a data dir restored without them)."""
    begin_write(session)
    session.execute(delete(MergedFile).where(MergedFile.key.in_(keys)))
    session.commit()


def finish_compiling(session: Session, job_id: int, built: dict[str, Any]) -> None:
    """compiling → ready with its program (``built``: key, manifest, answer_len); a cancelled job stays so."""
    begin_write(session)
    job = session.get_one(Job, job_id)
    program = program_row(session, job.model_id, built["key"], built["manifest"])
    session.flush()
    session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == "compiling")
        .values(status="ready", program_id=program.id, answer_len=built["answer_len"], updated_at=utcnow())
    )
    session.commit()


def fail(session: Session, job_id: int, error: str, from_statuses: tuple[str, ...]) -> bool:
    """→ failed with ``error`` if the job is still in one of ``from_statuses``."""
    begin_write(session)
    moved = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status.in_(from_statuses))
        .values(status="failed", error=error[:4000], leased_device_id=None, lease_expires_at=None, updated_at=utcnow())
    ).rowcount
    session.commit()
    return bool(moved)


def device_failed(session: Session, job: Job, device: Device, error: str) -> bool:
    """running → failed with the device's reason, if the device holds the job's lease."""
    begin_write(session)
    moved = session.execute(
        update(Job)
        .where(Job.id == job.id, Job.status == "running", Job.leased_device_id == device.id)
        .values(status="failed", error=f"device {device.id}: {error}", lease_expires_at=None, updated_at=utcnow())
        .execution_options(synchronize_session=False)
    ).rowcount
    session.commit()
    return bool(moved)


def succeed(session: Session, job: Job, device: Device, steps: int) -> bool:
    """running → succeeded if the device still holds the lease; the caller commits, together with the adapter."""
    begin_write(session)
    moved = session.execute(
        update(Job)
        .where(Job.id == job.id, Job.status == "running", Job.leased_device_id == device.id)
        .values(status="succeeded", lease_expires_at=None, progress_step=steps, updated_at=utcnow())
    ).rowcount
    return bool(moved)


class VersionTaken(Exception):
    """Every try at recording a result lost its adapter version number to a concurrent result."""


ACCEPT_ATTEMPTS = 3  # a concurrent result of the same (user, model, task) may take the version number


def accept_result(
    session: Session,
    job: Job,
    device: Device,
    files: registry.StoredFiles,
    metrics: dict[str, Any],
) -> Adapter | None:
    """A verified result whose files are published already (``files``): running → succeeded and the job's next
    adapter version (``files``, ``metrics``) in one transaction, so a recorded adapter always has its files and
    no file I/O holds the write lock. None (nothing written) when the device no longer holds the lease. Tried
    again when a concurrent result took the version number; ``VersionTaken`` after ``ACCEPT_ATTEMPTS``."""
    spec = device_spec(job).model_dump(mode="json")
    for _ in range(ACCEPT_ATTEMPTS):
        begin_write(session)
        if not succeed(session, job, device, spec["steps"]):
            session.rollback()
            return None
        try:
            adapter = registry.add_version(session, job, spec, files, metrics)
            if job.standing_job_id is not None:
                end_session(session, job, adapter)
            session.commit()
            return adapter
        except IntegrityError:
            session.rollback()
    raise VersionTaken(f"job {job.id}: could not allocate an adapter version")


def promotes(held_out: dict[str, Any] | None) -> bool:
    """The promotion rule of a standing job's session: its held-out loss after training is below its loss before
    (the version the session started from, measured on the same held-out slice of the same data)."""
    if held_out is None:
        return False
    before, after = held_out["before"].get("loss"), held_out["after"].get("loss")
    return before is not None and after is not None and after < before


def end_session(session: Session, job: Job, adapter: Adapter) -> None:
    """A session of a standing job published ``adapter``: promoted (``promotes``) if the session started from the
    standing job's promoted version (else kept, not promoted); the standing job succeeds once ``sessions`` of its
    sessions published a version. The caller commits, with the session's ``succeeded`` and its adapter."""
    begin_write(session)
    standing = session.scalars(select(Job).where(Job.id == job.standing_job_id).with_for_update()).one()
    start = standing.promoted_adapter_id or standing.init_adapter_id
    adapter.promoted = job.init_adapter_id == start and promotes(adapter.held_out)
    values: dict[str, Any] = {"updated_at": utcnow()}
    if adapter.promoted:
        values["promoted_adapter_id"] = adapter.id
    cap = standing.spec.get("sessions")
    if cap is not None and sessions_run(session, standing.id) >= cap:
        values["status"] = "succeeded"
    session.execute(update(Job).where(Job.id == standing.id, Job.status == "ready").values(**values))


def sessions_run(session: Session, standing_job_id: int) -> int:
    """A standing job's sessions that published a version."""
    done = select(func.count(Job.id)).where(Job.standing_job_id == standing_job_id, Job.status == "succeeded")
    return session.scalar(done) or 0


def lease_session(session: Session, device: LeasingDevice, lease_s: int, max_attempts: int) -> Job | None:
    """The next session of the oldest standing job of the device's user that fits it (as ``lease_next``) and has
    no session in flight: a new job, ``running`` under the device's lease, with the standing job's spec and program,
    starting from its promoted adapter (before a first promotion, the standing job's own starting adapter, if any).
    None when there is none; commits. A standing job whose last ``max_attempts`` sessions all failed fails instead,
    with the last one's reason (a device that cannot run it would otherwise start a session at every poll).

    The standing job's row is locked (``FOR UPDATE SKIP LOCKED``), so two devices of one user asking at once cannot
    both start a session of it."""
    begin_write(session)
    standing = _standing_to_run(session, device)
    if standing is None or _has_live_session(session, standing.id):
        session.commit()
        return None
    now = utcnow()
    if _sessions_keep_failing(session, standing, max_attempts, now):
        session.commit()
        return None
    start = standing.promoted_adapter_id or standing.init_adapter_id
    job = Job(
        user_id=standing.user_id,
        model_id=standing.model_id,
        task=standing.task,
        spec={**standing.spec, "standing": False, "sessions": None, "init_adapter_id": start},
        answer_len=standing.answer_len,
        status="running",
        device_id=standing.device_id,
        device_backend=standing.device_backend,
        init_adapter_id=start,
        program_id=standing.program_id,
        standing_job_id=standing.id,
        leased_device_id=device.id,
        lease_expires_at=now + timedelta(seconds=lease_s),
        attempts=1,
    )
    session.add(job)
    standing.updated_at = now
    session.commit()
    return job


def _standing_to_run(session: Session, device: LeasingDevice) -> Job | None:
    """The oldest ready standing job of the device's user that fits it and has no session in flight, its row
    locked (skipping one another request holds)."""
    live = aliased(Job)
    in_flight = exists().where(live.standing_job_id == Job.id, live.status.not_in(TERMINAL_STATUSES))
    return session.scalars(
        select(Job)
        .where(
            Job.user_id == device.user_id,
            Job.standing.is_(True),
            Job.status == "ready",
            ~in_flight,
            *fits_device(device),
        )
        .order_by(Job.id)
        .limit(1)
        .with_for_update(skip_locked=True)
    ).first()


def _sessions_keep_failing(session: Session, standing: Job, max_attempts: int, now: datetime) -> bool:
    """Whether the standing job's last ``max_attempts`` sessions all failed; if so it fails now, with the last
    one's reason."""
    recent = session.execute(
        select(Job.status, Job.error)
        .where(Job.standing_job_id == standing.id)
        .order_by(Job.id.desc())
        .limit(max_attempts)
    ).all()
    if len(recent) < max_attempts or any(row.status != "failed" for row in recent):
        return False
    standing.status, standing.updated_at = "failed", now
    standing.error = f"its last {max_attempts} sessions failed; the last: {recent[0].error}"[:4000]
    return True


def _has_live_session(session: Session, standing_job_id: int) -> bool:
    """Read again once the standing job's row is locked (a new statement: on PostgreSQL a new snapshot, in which a
    racing request's session committed before the lock was granted is visible; the query that took the lock may
    have judged by an older one)."""
    live = select(Job.id).where(Job.standing_job_id == standing_job_id, Job.status.not_in(TERMINAL_STATUSES))
    return session.scalar(live.limit(1)) is not None


def cancel(session: Session, job: Job) -> bool:
    """→ cancelled unless the job already finished, a standing job's session in flight with it; the leased device
    learns it from its next heartbeat."""
    begin_write(session)
    now = utcnow()
    moved = session.execute(
        update(Job)
        .where(Job.id == job.id, Job.status.not_in(TERMINAL_STATUSES))
        .values(status="cancelled", lease_expires_at=None, updated_at=now)
    ).rowcount
    if moved and job.standing:
        session.execute(
            update(Job)
            .where(Job.standing_job_id == job.id, Job.status.not_in(TERMINAL_STATUSES))
            .values(status="cancelled", lease_expires_at=None, updated_at=now)
        )
    session.commit()
    session.refresh(job)
    return bool(moved)


def holds_lease(job: Job | Any, device_id: int) -> bool:
    """The precondition of a device's work on a job, as loaded (a row or a Core result): running under its lease.
    The writes that act on it test the same in their UPDATE (``heartbeat``, ``succeed``, ``device_failed``), so a
    lease lost after this check changes nothing."""
    return job.status == "running" and job.leased_device_id == device_id


def client_is_open(client: RoundClient, round_: Round, fed: dict[str, Any] | None = None, newest: int = 0) -> bool:
    """The precondition of a round client's upload, as loaded: it holds its part in a round still open (the
    report's UPDATE tests it again: ``_client_is_live``). A buffered job's part (``fed``, the job's federation, and
    ``newest``, the index of its newest round) stays open after its round closed, while it is at most
    ``max_staleness`` versions old."""
    if client.status != "leased":
        return False
    if not buffered(fed):
        return round_.status == "open"
    return round_.status != "failed" and newest - round_.index <= fed["max_staleness"]


def buffered(fed: dict[str, Any] | None) -> bool:
    """Whether a federated job's rounds are buffered (``FederationSpec.mode``; jobs of earlier versions: sync)."""
    return fed is not None and fed.get("mode", "sync") == "buffered"


def held_work(session: Session, device_id: int) -> list[tuple[int, str | None]]:
    """The work the device holds now, as (program id, the starting B's sha256 or None): its running jobs under its
    lease (``holds_lease``) and the round parts it still holds (leased: a synchronous round's end expires them, a
    buffered job's once they are too old), B_r the starting B. What it may download for its work is these
    programs' files and these B's (``server.grants``)."""
    jobs = (
        select(Job.program_id, Adapter.b_sha256)
        .outerjoin(Adapter, Adapter.id == Job.init_adapter_id)
        .where(Job.status == "running", Job.leased_device_id == device_id)
    )
    parts = (
        select(Job.program_id, Round.b_sha256)
        .join(Round, Round.job_id == Job.id)
        .join(RoundClient, RoundClient.round_id == Round.id)
        .where(RoundClient.device_id == device_id, RoundClient.status == "leased", Round.status != "failed")
    )
    return [(row[0], row[1]) for query in (jobs, parts) for row in session.execute(query) if row[0] is not None]


def revoke_device(session: Session, device_id: int) -> bool:
    """live → revoked, its leases released in the same transaction: its running jobs go back to ready (the attempt
    stays counted) and its round parts expire (their slots are free again). Commits; → whether it was live.

    Every device route reads the row (or, for a heartbeat, tests it in its UPDATE), so the token is refused from
    the next request on, by every API process: the processes' token caches hold only what never changes."""
    begin_write(session)
    now = utcnow()
    revoked = session.execute(
        update(Device).where(Device.id == device_id, Device.revoked_at.is_(None)).values(revoked_at=now)
    ).rowcount
    if revoked:
        session.execute(
            update(Job)
            .where(Job.status == "running", Job.leased_device_id == device_id)
            .values(status="ready", leased_device_id=None, lease_expires_at=None, updated_at=now)
        )
        session.execute(
            update(RoundClient)
            .where(RoundClient.status == "leased", RoundClient.device_id == device_id)
            .values(status="expired", lease_expires_at=None)
        )
    session.commit()
    return bool(revoked)


def _expire(scope: Any) -> Update:
    exhausted = Job.attempts >= bindparam("max_attempts")
    return (
        update(Job)
        .where(Job.status == "running", Job.lease_expires_at < bindparam("now"), scope)
        .values(
            status=case((exhausted, "failed"), else_="ready"),
            error=case((exhausted, bindparam("exhausted")), else_=Job.error),
            leased_device_id=None,
            lease_expires_at=None,
            updated_at=bindparam("now"),
        )
    )


_EXPIRE_ALL, _EXPIRE_USER = _expire(true()), _expire(Job.user_id == bindparam("user"))  # built once


def expire_leases(session: Session, max_attempts: int, user_id: int | None = None, now: datetime | None = None) -> None:
    """Running jobs whose lease ran out go back to ready, or fail after ``max_attempts`` leases, in one statement
    (the caller commits); only ``user_id``'s jobs when given (a lease request: no other user's job could be handed to
    the device)."""
    begin_write(session)
    values = {"now": now or utcnow(), "max_attempts": max_attempts, "user": user_id}
    values["exhausted"] = f"lease expired {max_attempts} times without a result"
    session.connection().execute(_EXPIRE_ALL if user_id is None else _EXPIRE_USER, values)


def sweep_leases(session: Session, max_attempts: int) -> None:
    """The lease sweeper's transition: every expired lease ends (``expire_leases``), in one transaction."""
    begin_write(session)
    expire_leases(session, max_attempts)
    session.commit()


def fits_memory(free_mb: int | None):
    """SQL condition: the job's program needs at most ``free_mb`` (no report, or no estimate: it fits)."""
    if free_mb is None:
        return true()
    needs = select(Program.memory_mb).where(Program.id == Job.program_id).scalar_subquery()
    return or_(needs.is_(None), needs <= free_mb)


def fits_device(device: LeasingDevice) -> tuple:
    """SQL conditions: a job this device may run (for it or any device, its backend or any, its memory)."""
    return (
        or_(Job.device_id.is_(None), Job.device_id == device.id),
        or_(Job.device_backend.is_(None), Job.device_backend == device.backend),
        fits_memory(device.memory_mb),
    )


def lease_next(session: Session, device: LeasingDevice, lease_s: int) -> Job | None:
    """Hand the oldest ready job of the device's user that fits it to the device (ready → running); never a
    standing job itself (``lease_session`` starts its sessions).

    Fits: the job names this device or none, wants this device's backend or any, and its program's memory
    estimate is within the free memory the device last reported (unknown on either side: it fits).

    ``FOR UPDATE SKIP LOCKED`` lets concurrent lease requests on PostgreSQL each take a different job instead of
    queueing on the same row; SQLite ignores it and needs nothing more, its transactions taking the write lock.
    """
    begin_write(session)
    job = session.scalars(
        select(Job)
        .where(
            Job.user_id == device.user_id,
            Job.status == "ready",
            Job.standing.is_(False),  # a standing job's work is its sessions (lease_session)
            *fits_device(device),
        )
        .order_by(Job.id)
        .limit(1)
        .with_for_update(skip_locked=True)
    ).first()
    if job is not None:
        now = utcnow()
        job.status, job.leased_device_id, job.attempts = "running", device.id, job.attempts + 1
        job.lease_expires_at, job.updated_at = now + timedelta(seconds=lease_s), now
        job.progress_step = job.progress_loss = job.progress_steps_per_s = None
    session.commit()
    return job


_REVOKED = exists().where(Device.id == bindparam("holder"), Device.revoked_at.is_not(None))
_HEARTBEAT = (
    update(Job)
    .where(
        Job.id == bindparam("job_id"),
        Job.status == "running",
        Job.leased_device_id == bindparam("holder"),
        Job.lease_expires_at >= bindparam("now"),
        Job.spec["steps"].as_integer() >= bindparam("step"),
        or_(bindparam("no_loss", type_=Boolean), ~Job.private),  # a private job's losses stay on the device
        ~_REVOKED,  # a lease granted while its device was being revoked ends at the first heartbeat
    )
    .values(
        lease_expires_at=bindparam("expires"),
        updated_at=bindparam("now"),
        progress_step=bindparam("step"),
        progress_loss=bindparam("loss"),
        progress_steps_per_s=bindparam("steps_per_s"),
    )
)  # built once: building the statement cost as much as running it


def heartbeat(
    engine: Engine, job_id: int, device: DeviceIdentity, lease_s: int, progress: HeartbeatCreate, seen: SeenMemo
) -> datetime | None:
    """Extend the device's lease and record progress → the new expiry; None when the update did not apply: the
    job is not running under this device's unexpired lease, ``progress.step`` is beyond its steps, or a private
    job's heartbeat carries a loss (the caller reads the job to say which). One conditional UPDATE, so the check
    and the write cannot be split by another request, in a transaction on a connection of its own (no session:
    the hot path); the device's ``last_seen_at`` with it when ``seen`` says it is due (at most every 30 s)."""
    now = utcnow()
    expires = now + timedelta(seconds=lease_s)
    values = {"job_id": job_id, "holder": device.id, "now": now, "expires": expires, "step": progress.step}
    values |= {"loss": progress.loss, "no_loss": progress.loss is None, "steps_per_s": progress.steps_per_s}
    due = seen.due(device.id)
    with engine.begin() as conn:
        moved = conn.execute(_HEARTBEAT, values).rowcount
        if due:
            accounts.record_seen(conn, device)
    if due:
        seen.recorded(device.id)
    return expires if moved else None


# --- federated rounds ----------------------------------------------------------------------------------------------


def open_first_round(session: Session, job: Job, b_sha256: str) -> Round | None:
    """ready → running with round 0 open from ``b_sha256`` (B_0); the open round if another request did it first.
    Flushed (the caller commits, with the lease)."""
    begin_write(session)
    moved = session.execute(
        update(Job).where(Job.id == job.id, Job.status == "ready").values(status="running", updated_at=utcnow())
    ).rowcount
    if moved:
        session.add(Round(job_id=job.id, index=0, status="open", b_sha256=b_sha256))
        session.flush()
    return open_round(session, job.id)


def open_round(session: Session, job_id: int) -> Round | None:
    """The job's open round, locked for the caller's transaction (PostgreSQL; SQLite's writer lock does it)."""
    begin_write(session)
    return session.scalars(
        select(Round).where(Round.job_id == job_id, Round.status == "open").with_for_update()
    ).first()


def lease_round_client(
    session: Session, round_: Round, device: LeasingDevice, seed: int, lease_s: int, timeout_s: float
) -> RoundClient:
    """A new client of an open round on ``device``; the first one starts the round's clock (flushed; the caller
    commits)."""
    begin_write(session)
    now = utcnow()
    if round_.deadline_at is None:
        round_.deadline_at = now + timedelta(seconds=timeout_s)
    client = RoundClient(
        round_id=round_.id,
        user_id=device.user_id,
        device_id=device.id,
        device_backend=device.backend,
        seed=seed,
        status="leased",
        lease_expires_at=now + timedelta(seconds=lease_s),
    )
    session.add(client)
    session.flush()
    return client


@dataclass(frozen=True)
class RoundPart:
    """What taking a part in a job's round depends on: K (``clients``), the round's timeout, the lease, the client's
    seed from (round index, slot), for a private job its ledger claim (``room``; it writes the claim in the
    caller's transaction and answers whether the part fits), and for a buffered job the parts it lets be in flight
    at once (``in_flight``; None: a synchronous round's K)."""

    clients: int
    timeout_s: float
    lease_s: int
    seed: Callable[[int, int], int]
    room: Callable[[Session], bool] | None = None
    in_flight: int | None = None


def take_round_part(
    session: Session, job: Job, device: LeasingDevice, part: RoundPart, first_b: str | None
) -> RoundClient | None:
    """A part in the job's open round for the device, in one transaction (round 0 opened from ``first_b``, B_0,
    while the job is still ready) → its client; None when the round is full (K clients hold or finished a part),
    the device's user has a part in it already, a private job's part does not fit (``part.room``), or another
    device of the same user took the part meanwhile."""
    begin_write(session)
    round_ = open_first_round(session, job, first_b) if first_b is not None else open_round(session, job.id)
    if round_ is None or _has_no_slot_for(session, round_, device.user_id, part):
        session.commit()  # round 0 stays open
        return None
    if part.room is not None and not part.room(session):
        session.commit()
        return None
    slot = session.scalar(select(func.count(RoundClient.id)).where(RoundClient.round_id == round_.id))
    try:
        seed = part.seed(round_.index, slot)
        client = lease_round_client(session, round_, device, seed, part.lease_s, part.timeout_s)
        session.commit()
    except IntegrityError:  # another device of the same user took the round's part meanwhile
        session.rollback()
        return None
    return client


def _has_no_slot_for(session: Session, round_: Round, user_id: int, part: RoundPart) -> bool:
    """The user has a part in the round already, or the round is full: K clients hold or finished a part of it (a
    buffered job: ``part.in_flight`` parts of any of its rounds are in flight)."""
    mine = select(RoundClient.id).where(RoundClient.round_id == round_.id, RoundClient.user_id == user_id)
    if session.scalar(mine.limit(1)) is not None:
        return True
    if part.in_flight is None:
        taken = select(func.count(RoundClient.id)).where(
            RoundClient.round_id == round_.id, RoundClient.status.in_(("leased", "reported"))
        )
        return session.scalar(taken) >= part.clients
    flying = (
        select(func.count(RoundClient.id))
        .join(Round, Round.id == RoundClient.round_id)
        .where(Round.job_id == round_.job_id, RoundClient.status == "leased")
    )
    return session.scalar(flying) >= part.in_flight


def _live_rounds(job: Job):
    """SQL: the rounds a part of ``job`` may still report into: its open round; for a buffered job, while it runs,
    any of its rounds not failed within ``max_staleness`` of its newest."""
    if not buffered(job.federation):
        return select(Round.id).where(Round.job_id == job.id, Round.status == "open")
    newest = select(func.max(Round.index)).where(Round.job_id == job.id).scalar_subquery()
    running = select(Job.status).where(Job.id == job.id).scalar_subquery() == "running"
    return select(Round.id).where(
        Round.job_id == job.id,
        Round.status != "failed",
        Round.index >= newest - job.federation["max_staleness"],
        running,
    )


def _client_is_live(session: Session, client: RoundClient):
    """SQL condition: the client holds an unexpired lease in a round it may still report into (``_live_rounds``)."""
    job = session.get_one(Job, session.get_one(Round, client.round_id).job_id)
    return and_(
        RoundClient.id == client.id,
        RoundClient.status == "leased",
        RoundClient.lease_expires_at >= utcnow(),
        RoundClient.round_id.in_(_live_rounds(job)),
    )


def client_heartbeat(
    session: Session, client: RoundClient, device: DeviceIdentity, lease_s: int, step: int, seen: SeenMemo
) -> datetime | None:
    """Extend a round client's lease → the new expiry; None when its lease or its round is over, or its device
    was revoked. The device's ``last_seen_at`` in the same transaction when ``seen`` says it is due."""
    begin_write(session)
    expires = utcnow() + timedelta(seconds=lease_s)
    revoked = exists().where(Device.id == device.id, Device.revoked_at.is_not(None))
    moved = session.execute(
        update(RoundClient)
        .where(_client_is_live(session, client), ~revoked)
        .values(lease_expires_at=expires, progress_step=step)
        .execution_options(synchronize_session=False)
    ).rowcount
    due = seen.due(device.id)
    if due:
        accounts.record_seen(session, device)
    session.commit()
    if due:
        seen.recorded(device.id)
    return expires if moved else None


def client_reported(session: Session, client: RoundClient, report: dict[str, Any]) -> bool:
    """leased → reported with its replayed B (``report``: log_sha256, b_sha256, mean_loss, replay_s, log_bytes), if
    its lease and its round are still open: a straggler's late report changes nothing (the caller answers 409)."""
    begin_write(session)
    moved = session.execute(
        update(RoundClient)
        .where(_client_is_live(session, client))
        .values(status="reported", reported_at=utcnow(), lease_expires_at=None, **report)
        .execution_options(synchronize_session=False)
    ).rowcount
    session.commit()
    return bool(moved)


def client_gave_up(session: Session, client: RoundClient) -> bool:
    """leased → expired at the device's request: its slot in the round is free again."""
    begin_write(session)
    moved = session.execute(
        update(RoundClient)
        .where(_client_is_live(session, client))
        .values(status="expired", lease_expires_at=None)
        .execution_options(synchronize_session=False)
    ).rowcount
    session.commit()
    return bool(moved)


def expire_round_clients(session: Session, now: datetime | None = None) -> None:
    """Clients whose lease ran out (killed, or gone quiet) free their slot: leased → expired (the caller commits)."""
    begin_write(session)
    now = now or utcnow()
    session.execute(
        update(RoundClient)
        .where(RoundClient.status == "leased", RoundClient.lease_expires_at < now)
        .values(status="expired", lease_expires_at=None)
    )


def sweep_round_clients(session: Session) -> None:
    """The round sweeper's transition: every client whose lease ran out frees its slot (``expire_round_clients``),
    in one transaction."""
    begin_write(session)
    expire_round_clients(session)
    session.commit()


class CloseTakenOver(Exception):
    """The round is no longer closing under this attempt: it was given up as stale and another close took it."""


def begin_close(session: Session, round_id: int) -> datetime | None:
    """open → closing → the attempt's stamp (``closing_at``), or None when another request or sweep is closing the
    round: only one aggregates it. The later transitions of the close name the stamp."""
    begin_write(session)
    now = utcnow()
    moved = session.execute(
        update(Round).where(Round.id == round_id, Round.status == "open").values(status="closing", closing_at=now)
    ).rowcount
    session.commit()
    return now if moved else None


def _closing(round_: Round, closing_at: datetime) -> Any:
    return and_(Round.id == round_.id, Round.status == "closing", Round.closing_at == closing_at)


def finish_close(
    session: Session,
    round_: Round,
    closing_at: datetime,
    files: registry.StoredFiles,
    metrics: dict[str, Any],
    counted: list[int],
    next_momentum: str | None = None,
) -> None:
    """closing → closed with its adapter, the cohort's next version (``files``: B_{r+1} and the round's record;
    ``metrics``); the reports it aggregated (``counted``, client ids) say so; the next round opens from B_{r+1} and
    ``next_momentum`` (m_{r+1}, server-side momentum), or after the last round the job succeeds. Leased clients left
    behind are stragglers: expired (a buffered job's only once the next version would find them more than
    ``max_staleness`` old). Commits; raises ``CloseTakenOver`` (nothing written) when this attempt no longer holds
    the round."""
    begin_write(session)
    job = session.get_one(Job, round_.job_id)
    adapter = registry.add_cohort_version(session, job, round_, files, metrics)
    now = utcnow()
    stats = {"mean_loss": metrics["mean_loss"], "aggregate_s": metrics["aggregate_s"]}
    moved = session.execute(
        update(Round)
        .where(_closing(round_, closing_at))
        .values(status="closed", adapter_id=adapter.id, closed_at=now, **stats)
    ).rowcount
    if not moved:
        session.rollback()
        raise CloseTakenOver(f"round {round_.index} of job {round_.job_id} was taken over by another close")
    next_b = files.b_sha256
    if counted:
        session.execute(update(RoundClient).where(RoundClient.id.in_(counted)).values(counted_in_round_id=round_.id))
    left_behind = RoundClient.round_id == round_.id
    if buffered(job.federation):
        too_old = round_.index - job.federation["max_staleness"]
        left_behind = RoundClient.round_id.in_(select(Round.id).where(Round.job_id == job.id, Round.index <= too_old))
    session.execute(
        update(RoundClient)
        .where(left_behind, RoundClient.status == "leased")
        .values(status="expired", lease_expires_at=None)
    )
    if round_.index + 1 < job.federation["rounds"]:
        session.add(
            Round(job_id=job.id, index=round_.index + 1, status="open", b_sha256=next_b, momentum_sha256=next_momentum)
        )
    else:
        session.execute(
            update(Job)
            .where(Job.id == job.id, Job.status == "running")
            .values(status="succeeded", progress_step=job.spec["steps"], updated_at=now)
        )
    session.commit()


def retry_close(session: Session, round_: Round, closing_at: datetime) -> None:
    """closing → open: aggregation stopped on a failure that says nothing about the round (its worker died or
    timed out, the database hiccuped); the sweeper closes it again, as it closes any open round that is full or
    past its deadline."""
    begin_write(session)
    session.execute(update(Round).where(_closing(round_, closing_at)).values(status="open", closing_at=None))
    session.commit()


def reopen_closing_rounds(session: Session) -> int:
    """closing → open for rounds a stopped server left mid-close (at the start of the one server of a data dir:
    nobody else can be closing them) → how many; the sweeper closes them again."""
    begin_write(session)
    moved = session.execute(
        update(Round).where(Round.status == "closing").values(status="open", closing_at=None)
    ).rowcount
    session.commit()
    return moved


def reopen_stale_closes(session: Session, older_than: timedelta) -> int:
    """closing → open for closes that began more than ``older_than`` ago (longer than any close may take: the
    process running it died) → how many. With several API processes this is how a round left mid-close gets
    closed again; should the old closer still be alive, its attempt no longer holds the round."""
    begin_write(session)
    stale = or_(Round.closing_at.is_(None), Round.closing_at < utcnow() - older_than)
    moved = session.execute(
        update(Round).where(Round.status == "closing", stale).values(status="open", closing_at=None)
    ).rowcount
    session.commit()
    return moved


def abort_close(session: Session, round_: Round, closing_at: datetime, error: str) -> None:
    """closing → failed, and the job with it (aggregation could not finish: a missing file, a worker error)."""
    begin_write(session)
    moved = session.execute(
        update(Round).where(_closing(round_, closing_at)).values(status="failed", closed_at=utcnow())
    ).rowcount
    session.commit()
    if moved:
        fail(session, round_.job_id, f"round {round_.index}: {error}", ("running",))


def reopen(session: Session, round_: Round, timeout_s: float) -> bool:
    """At the timeout with fewer than M reports, once: the round stays open for another ``timeout_s``."""
    begin_write(session)
    moved = session.execute(
        update(Round)
        .where(Round.id == round_.id, Round.status == "open", Round.reopened == 0)
        .values(reopened=1, deadline_at=utcnow() + timedelta(seconds=timeout_s))
    ).rowcount
    session.commit()
    return bool(moved)


def fail_round(session: Session, round_: Round, reason: str) -> bool:
    """open → failed at its second timeout with fewer than M reports; the job fails with the reason."""
    begin_write(session)
    moved = session.execute(
        update(Round).where(Round.id == round_.id, Round.status == "open").values(status="failed", closed_at=utcnow())
    ).rowcount
    session.commit()
    if moved:
        fail(session, round_.job_id, f"round {round_.index}: {reason}", ("running",))
    return bool(moved)
