"""The job state machine: the one module that writes ``Job.status``, as small database transitions shared by the
routes, the compile queue and the lease sweeper (``tests/server/test_structure.py`` keeps it so).

    queued → compiling → ready → running → succeeded
                 ↘ failed       ↑   ↓ ↘ failed (lease expired max_attempts times)
                                └───┘ lease expired: back to ready, attempts counted
    cancelled from any state before succeeded/failed.

Transitions that race (a heartbeat against the sweeper, a result against a cancel) are conditional UPDATEs
checked by their row count, which is safe on SQLite and on PostgreSQL alike; leasing locks the row it takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, or_, select, true, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from server.tables import Device, Job, Model, Program, utcnow
from shared.manifest import ProgramManifest
from shared.schemas import TERMINAL_STATUSES, JobCreate, JobSpec


def submit(session: Session, **columns: Any) -> Job:
    """A new job (``columns``: the ``Job`` fields but the state), queued for the compile queue."""
    job = Job(**columns, status="queued")
    session.add(job)
    session.commit()
    return job


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
    ids = list(session.scalars(select(Job.id).where(Job.status.in_(("queued", "compiling"))).order_by(Job.id)))
    session.execute(update(Job).where(Job.id.in_(ids)).values(status="queued"))
    session.commit()
    return ids


def start_compiling(session: Session, job_id: int) -> CompileInput | None:
    """queued → compiling; None when the job is gone or no longer queued (cancelled meanwhile)."""
    moved = session.execute(
        update(Job).where(Job.id == job_id, Job.status == "queued").values(status="compiling", updated_at=utcnow())
    ).rowcount
    if not moved:
        session.rollback()
        return None
    job = session.get_one(Job, job_id)
    model = session.get_one(Model, job.model_id)
    session.commit()
    return CompileInput(job.id, model.path, model.sha256, dict(job.spec))


def _program_row(session: Session, model_id: int, built: dict[str, Any]) -> Program:
    """The Program row for ``built["key"]``, inserted if this is the first job with that config."""
    existing = session.scalar(select(Program).where(Program.key == built["key"]))
    if existing is not None:
        return existing
    memory_mb = ProgramManifest.model_validate(built["manifest"]).memory_mb
    program = Program(key=built["key"], model_id=model_id, manifest=built["manifest"], memory_mb=memory_mb)
    try:
        with session.begin_nested():
            session.add(program)
    except IntegrityError:  # another job with the same config got there first
        return session.scalars(select(Program).where(Program.key == built["key"])).one()
    return program


def finish_compiling(session: Session, job_id: int, built: dict[str, Any]) -> None:
    """compiling → ready with its program (``built``: key, manifest, answer_len); a cancelled job stays so."""
    job = session.get_one(Job, job_id)
    program = _program_row(session, job.model_id, built)
    session.flush()
    session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == "compiling")
        .values(status="ready", program_id=program.id, answer_len=built["answer_len"], updated_at=utcnow())
    )
    session.commit()


def fail(session: Session, job_id: int, error: str, from_statuses: tuple[str, ...]) -> bool:
    """→ failed with ``error`` if the job is still in one of ``from_statuses``."""
    moved = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status.in_(from_statuses))
        .values(status="failed", error=error[:4000], leased_device_id=None, lease_expires_at=None, updated_at=utcnow())
    ).rowcount
    session.commit()
    return bool(moved)


def device_failed(session: Session, job: Job, device: Device, error: str) -> bool:
    """running → failed with the device's reason, if the device holds the job's lease."""
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
    moved = session.execute(
        update(Job)
        .where(Job.id == job.id, Job.status == "running", Job.leased_device_id == device.id)
        .values(status="succeeded", lease_expires_at=None, progress_step=steps, updated_at=utcnow())
    ).rowcount
    return bool(moved)


def cancel(session: Session, job: Job) -> bool:
    """→ cancelled unless the job already finished; the leased device learns it from its next heartbeat."""
    moved = session.execute(
        update(Job)
        .where(Job.id == job.id, Job.status.not_in(TERMINAL_STATUSES))
        .values(status="cancelled", lease_expires_at=None, updated_at=utcnow())
    ).rowcount
    session.commit()
    session.refresh(job)
    return bool(moved)


def expire_leases(session: Session, max_attempts: int, now: datetime | None = None) -> None:
    """Running jobs whose lease ran out go back to ready, or fail after ``max_attempts`` leases (caller commits)."""
    now = now or utcnow()
    expired = and_(Job.status == "running", Job.lease_expires_at < now)
    session.execute(
        update(Job)
        .where(expired, Job.attempts >= max_attempts)
        .values(
            status="failed",
            error=f"lease expired {max_attempts} times without a result",
            leased_device_id=None,
            lease_expires_at=None,
            updated_at=now,
        )
    )
    session.execute(
        update(Job).where(expired).values(status="ready", leased_device_id=None, lease_expires_at=None, updated_at=now)
    )


def _fits_memory(free_mb: int | None):
    """SQL condition: the job's program needs at most ``free_mb`` (no report, or no estimate: it fits)."""
    if free_mb is None:
        return true()
    needs = select(Program.memory_mb).where(Program.id == Job.program_id).scalar_subquery()
    return or_(needs.is_(None), needs <= free_mb)


def lease_next(session: Session, device: Device, lease_s: int) -> Job | None:
    """Hand the oldest ready job of the device's user that fits it to the device (ready → running).

    Fits: the job names this device or none, wants this device's backend or any, and its program's memory
    estimate is within the free memory the device last reported (unknown on either side: it fits).

    ``FOR UPDATE SKIP LOCKED`` lets concurrent lease requests on PostgreSQL each take a different job instead of
    queueing on the same row; SQLite ignores it and needs nothing more, its transactions taking the write lock.
    """
    job = session.scalars(
        select(Job)
        .where(
            Job.user_id == device.user_id,
            Job.status == "ready",
            or_(Job.device_id.is_(None), Job.device_id == device.id),
            or_(Job.device_backend.is_(None), Job.device_backend == device.backend),
            _fits_memory(device.memory_mb),
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


def heartbeat(session: Session, job: Job, device: Device, lease_s: int, progress: dict[str, Any]) -> datetime | None:
    """Extend the device's lease and record progress → the new expiry; None when the device lost the lease."""
    now = utcnow()
    expires = now + timedelta(seconds=lease_s)
    moved = session.execute(
        update(Job)
        .where(
            Job.id == job.id,
            Job.status == "running",
            Job.leased_device_id == device.id,
            Job.lease_expires_at >= now,
        )
        .values(
            lease_expires_at=expires,
            updated_at=now,
            progress_step=progress["step"],
            progress_loss=progress["loss"],
            progress_steps_per_s=progress["steps_per_s"],
        )
        .execution_options(synchronize_session=False)
    ).rowcount
    session.commit()
    return expires if moved else None
