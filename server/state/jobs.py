"""A job's state machine (``server.state``'s transaction rule):

    queued → compiling → ready → running → succeeded
                 ↘ failed       ↑   ↓ ↘ failed (lease expired max_attempts times)
                                └───┘ lease expired: back to ready, attempts counted
    cancelled from any state before succeeded/failed.

Here the transitions up to ``ready``, failure and cancel, and which ready jobs fit a device; a lease and what
ends it are ``server.state.leases``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    or_,
    select,
    true,
    update,
)
from sqlalchemy.orm import Session

from server.db import begin_write
from server.state.programs import program_row
from server.tables import (
    Job,
    LeasingDevice,
    Model,
    Program,
    utcnow,
)
from shared.schemas import TERMINAL_STATUSES, JobCreate, JobSpec

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
