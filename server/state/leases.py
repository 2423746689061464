"""A device's work under its lease (``server.state``'s transaction rule): ``lease`` hands a device the oldest ready
job that fits it, or the next session of a standing job (``server.state.sessions``), in one unit of work with what
the device reports and its user's expired leases; a heartbeat keeps the lease;
it ends by a result (``accept_result``), the device's failure, its expiry (back to ready, or failed after
``max_attempts`` leases), or the device's revocation.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    Boolean,
    Engine,
    Update,
    bindparam,
    case,
    exists,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from server import accounts, registry
from server.accounts import SeenMemo
from server.db import begin_write
from server.state.jobs import device_spec, fits_device
from server.state.sessions import end_session, lease_session
from server.tables import (
    Adapter,
    Device,
    DeviceIdentity,
    Job,
    LeasingDevice,
    Round,
    RoundClient,
    utcnow,
)
from shared.schemas import HeartbeatCreate, LeaseCreate


@dataclass(frozen=True)
class Leased:
    """What a device's lease request got: the device as it reports itself now (what round work must fit), whether
    it asks for sessions and round work too (``eligible``), whether it is revoked, and the job it now holds."""

    device: LeasingDevice
    eligible: bool
    revoked: bool = False
    job: Job | None = None


def lease(
    session: Session, device: DeviceIdentity, report: LeaseCreate | None, lease_s: int, max_attempts: int
) -> Leased:
    """A device asks for work, in one unit of work: what it reports now (backend, free memory, CPU: stored when
    they changed, ``accounts.as_reported``), its last seen, its user's expired leases ended (``expire_leases``: no
    other user's job could be handed to it), then the oldest ready job that fits it (``lease_next``) or, for an
    eligible device (``report.eligible`` not false), the next session of a standing job
    (``state.sessions.lease_session``). Commits; a revoked device gets nothing, and nothing is written."""
    begin_write(session)
    reported = (None, None, None) if report is None else (report.backend, report.memory_mb, report.cpu)
    asking, revoked_at = accounts.as_reported(session, device, *reported)  # replaces what it reported before
    eligible = report is None or report.eligible is not False
    if revoked_at is not None:
        session.rollback()
        return Leased(asking, eligible, revoked=True)
    accounts.record_seen(session, device)
    expire_leases(session, max_attempts, device.user_id)
    job = lease_next(session, asking, lease_s)
    if job is None and eligible:  # sessions (and round work) only for devices whose policy holds
        job = lease_session(session, asking, lease_s, max_attempts)
    session.commit()
    return Leased(asking, eligible, job=job)


def lease_next(session: Session, device: LeasingDevice, lease_s: int) -> Job | None:
    """Hand the oldest ready job of the device's user that fits it to the device (ready → running); never a
    standing job itself (``lease_session`` starts its sessions). A step of ``lease`` (the caller commits).

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
    return job


def expire_leases(session: Session, max_attempts: int, user_id: int | None = None, now: datetime | None = None) -> None:
    """Running jobs whose lease ran out go back to ready, or fail after ``max_attempts`` leases, in one statement
    (the caller commits); only ``user_id``'s jobs when given (a lease request: no other user's job could be handed to
    the device)."""
    begin_write(session)
    values = {"now": now or utcnow(), "max_attempts": max_attempts, "user": user_id}
    values["exhausted"] = f"lease expired {max_attempts} times without a result"
    session.connection().execute(_EXPIRE_ALL if user_id is None else _EXPIRE_USER, values)


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


def sweep_leases(session: Session, max_attempts: int) -> None:
    """The lease sweeper's transition: every expired lease ends (``expire_leases``), in one transaction."""
    begin_write(session)
    expire_leases(session, max_attempts)
    session.commit()


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
