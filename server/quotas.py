"""Per-user limits on what costs the server work: active jobs, compiles in flight, enrollment codes per hour.

Each is counted in the database at the moment of asking (rows of the user's jobs or codes), so the limits hold
across several API processes sharing one database. Past a limit the request answers 429 with ``Retry-After``.
Two requests racing past the count may both pass: the limits bound what one user can pile up, they are not
accounting. The numbers live in ``server.settings.Settings`` (``max_active_jobs``, ``max_compiles``,
``enrollment_codes_per_hour``).
"""

from __future__ import annotations

from datetime import timedelta

from fastapi import HTTPException, status
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from server.settings import Settings
from server.tables import EnrollmentCode, Job, utcnow
from shared.schemas import TERMINAL_STATUSES

COMPILING = ("queued", "compiling")
JOB_RETRY_S = 60
HOUR = timedelta(hours=1)


def too_many(detail: str, retry_after_s: int) -> HTTPException:
    return HTTPException(status.HTTP_429_TOO_MANY_REQUESTS, detail, headers={"Retry-After": str(max(1, retry_after_s))})


def check_job_quota(session: Session, user_id: int, settings: Settings) -> None:
    """A new job must leave the user within ``max_active_jobs`` unfinished jobs and ``max_compiles`` compiles."""
    mine = select(func.count(Job.id)).where(Job.user_id == user_id)
    active = session.scalar(mine.where(Job.status.not_in(TERMINAL_STATUSES))) or 0
    if active >= settings.max_active_jobs:
        raise too_many(f"{active} unfinished jobs: the limit is {settings.max_active_jobs}", JOB_RETRY_S)
    compiling = session.scalar(mine.where(Job.status.in_(COMPILING))) or 0
    if compiling >= settings.max_compiles:
        raise too_many(f"{compiling} jobs waiting to compile: the limit is {settings.max_compiles}", JOB_RETRY_S)


def check_code_quota(session: Session, user_id: int, settings: Settings) -> None:
    """At most ``enrollment_codes_per_hour`` codes made in the last hour; Retry-After: until the oldest ages out."""
    since = utcnow() - HOUR
    count, oldest = session.execute(
        select(func.count(EnrollmentCode.id), func.min(EnrollmentCode.created_at)).where(
            EnrollmentCode.user_id == user_id, EnrollmentCode.created_at >= since
        )
    ).one()
    if count >= settings.enrollment_codes_per_hour:
        wait = int((oldest.replace(tzinfo=since.tzinfo) - since).total_seconds()) + 1
        limit = settings.enrollment_codes_per_hour
        raise too_many(f"{count} enrollment codes made in the last hour: the limit is {limit}", wait)
