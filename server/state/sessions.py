"""A standing job's sessions (``server.state``'s transaction rule). A standing job (``standing``) is never leased
itself: compiled, it stays ``ready`` — waiting for its next session — and each time an eligible device of its user
asks for work with no session of it in flight, ``lease_session`` creates a session, a job of its own that starts
``running`` under that device's lease from the standing job's promoted adapter, and then goes the ordinary way
(lease expiry, failure, cancel, result). A session's result (``accept_result``) promotes its version when its
held-out loss after is below before (the version it started from, on the same slice); after ``sessions`` sessions
that published a version the standing job succeeds. Cancelling a standing job cancels its session in flight.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    exists,
    func,
    select,
    update,
)
from sqlalchemy.orm import Session, aliased

from server.db import begin_write
from server.state.jobs import fits_device
from server.tables import (
    Adapter,
    Job,
    LeasingDevice,
    utcnow,
)
from shared.schemas import TERMINAL_STATUSES


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
    None when there is none; a step of ``state.leases.lease`` (the caller commits). A standing job whose last
    ``max_attempts`` sessions all failed fails instead, with the last one's reason (a device that cannot run it would
    otherwise start a session at every poll).

    The standing job's row is locked (``FOR UPDATE SKIP LOCKED``), so two devices of one user asking at once cannot
    both start a session of it."""
    begin_write(session)
    standing = _standing_to_run(session, device)
    if standing is None or _has_live_session(session, standing.id):
        return None
    now = utcnow()
    if _sessions_keep_failing(session, standing, max_attempts, now):
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
    session.flush()
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
