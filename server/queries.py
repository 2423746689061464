"""The reads the routes show: lists, counts and lookups by name, in one home (the state layer, ``server.state`` and
``server.accounts``, holds the writes). Routes issue no query of their own (``tests/server/test_structure.py``).

Each function reads in the caller's session and commits nothing; a list comes with its total count where the
route pages it (``skip``, ``limit``).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, Row, and_, func, or_, select
from sqlalchemy.orm import Session, aliased

from server import registry
from server.tables import (
    Adapter,
    Cohort,
    CohortMember,
    Device,
    Job,
    MergedFile,
    Model,
    Program,
    Round,
    RoundClient,
    ServerKey,
    User,
    WebSession,
    utcnow,
)


def models(session: Session) -> list[Model]:
    return list(session.scalars(select(Model).order_by(Model.id)))


def model_named(session: Session, name: str) -> Model | None:
    return session.scalar(select(Model).where(Model.name == name))


def merged_file(session: Session, key: str) -> MergedFile | None:
    """A kept merged download by its content key (``server.merged_builds``)."""
    return session.get(MergedFile, key)


def merged_keys(session: Session) -> set[str]:
    return set(session.scalars(select(MergedFile.key)))


def devices_of(session: Session, user_id: int) -> list[Device]:
    return list(session.scalars(select(Device).where(Device.user_id == user_id).order_by(Device.id)))


def all_devices(session: Session, skip: int, limit: int) -> tuple[list[Row[Any]], int]:
    """Every user's devices, newest first, each as (device, its user's name), and how many there are in all."""
    rows = session.execute(
        select(Device, User.name)
        .join(User, User.id == Device.user_id)
        .order_by(Device.id.desc())
        .offset(skip)
        .limit(limit)
    ).all()
    return list(rows), session.scalar(select(func.count(Device.id))) or 0


def cohorts(session: Session) -> list[Cohort]:
    return list(session.scalars(select(Cohort).order_by(Cohort.id)))


def cohort_members(session: Session, cohort_id: int) -> int:
    """How many users are in the cohort now (joined, not left)."""
    active = (CohortMember.cohort_id == cohort_id, CohortMember.left_at.is_(None))
    return session.scalar(select(func.count(CohortMember.id)).where(*active)) or 0


def personalized_from_cohort(session: Session, cohort_id: int) -> list[Row[Any]]:
    """The adapters the cohort's members (now: joined, not left) trained on their own data starting from one of the
    cohort's versions (the adapter's parent is the cohort's; the same task), oldest first, as (user id, adapter
    held-out figures, the cohort version it started from): a personal job's, or a standing job's session's."""
    start = aliased(Adapter)
    member = (CohortMember.cohort_id == cohort_id, CohortMember.user_id == Adapter.user_id)
    return list(
        session.execute(
            select(Adapter.user_id, Adapter.held_out, start.version)
            .join(start, start.id == Adapter.parent_id)
            .join(CohortMember, and_(*member))
            .where(start.cohort_id == cohort_id, Adapter.task == start.task, CohortMember.left_at.is_(None))
            .order_by(Adapter.id)
        )
    )


def jobs_of(session: Session, user_id: int | None, skip: int, limit: int) -> tuple[list[Row[Any]], int]:
    """A user's jobs, newest first, each as (job, model name, adapter id, adapter held-out figures); with no user
    (the admin), the cohorts' federated jobs → (page, total)."""
    mine = Job.user_id == user_id if user_id is not None else Job.cohort_id.is_not(None)
    rows = session.execute(
        select(Job, Model.name, Adapter.id, Adapter.held_out)
        .join(Model, Model.id == Job.model_id)
        .outerjoin(Adapter, or_(Adapter.job_id == Job.id, Adapter.id == Job.promoted_adapter_id))  # standing: promoted
        .where(mine)
        .order_by(Job.id.desc())
        .offset(skip)
        .limit(limit)
    ).all()
    return list(rows), session.scalar(select(func.count(Job.id)).where(mine)) or 0


def adapters_of(
    session: Session, user_id: int, model: str | None, task: str | None, skip: int, limit: int
) -> tuple[list[Row[Any]], int]:
    """The adapters the user may see (``registry.visible_to``), newest first, as (adapter, its model, its job and the
    job's program; None for a round's adapter), optionally of one model or task → (page, total). The rows hold what
    ``registry.adapter_public`` reads, each program loaded once, so building the answers queries nothing per row."""
    query = (
        select(Adapter, Model, Job)
        .join(Model, Model.id == Adapter.model_id)
        .outerjoin(Job, Job.id == Adapter.job_id)
        .where(registry.visible_to(user_id))
    )
    if model is not None:
        query = query.where(Model.name == model)
    if task is not None:
        query = query.where(Adapter.task == task)
    count = session.scalar(select(func.count()).select_from(query.subquery())) or 0
    rows = list(session.execute(query.order_by(Adapter.id.desc()).offset(skip).limit(limit)).all())
    wanted = {job.program_id for _, _, job in rows if job is not None and job.program_id is not None}
    programs = {p.id: p for p in session.scalars(select(Program).where(Program.id.in_(wanted)))} if wanted else {}
    return [(a, m, job, job and programs.get(job.program_id)) for a, m, job in rows], count


def rounds_of(session: Session, job_id: int) -> list[tuple[Round, list[RoundClient]]]:
    """A federated job's rounds in order, each with its clients in aggregation order."""
    rounds = session.scalars(select(Round).where(Round.job_id == job_id).order_by(Round.index)).all()
    clients = select(RoundClient).order_by(RoundClient.id)
    return [(round_, list(session.scalars(clients.where(RoundClient.round_id == round_.id)))) for round_ in rounds]


def sessions_of(session: Session, standing_job_id: int) -> list[tuple[Job, Adapter | None]]:
    """A standing job's sessions in order, each with the version it published (None: none, yet or ever)."""
    rows = session.execute(
        select(Job, Adapter)
        .outerjoin(Adapter, Adapter.job_id == Job.id)
        .where(Job.standing_job_id == standing_job_id)
        .order_by(Job.id)
    ).all()
    return [(job, adapter) for job, adapter in rows]


def heartbeat_refusal(conn: Connection, job_id: int, device_id: int) -> tuple[Row[Any] | None, Any]:
    """Why a job heartbeat did not apply, read after the fact: (the job's status, user, leaseholder and spec, or
    None; the device's ``revoked_at``)."""
    job = conn.execute(select(Job.status, Job.user_id, Job.leased_device_id, Job.spec).where(Job.id == job_id)).first()
    return job, conn.execute(select(Device.revoked_at).where(Device.id == device_id)).scalar_one_or_none()


def private_jobs_of(session: Session, owner: User | Cohort) -> list[Job]:
    """A user's private jobs, or a cohort's private federated jobs (``spec["privacy"]`` set), oldest first: the
    entries of its privacy ledger."""
    column = Job.cohort_id if isinstance(owner, Cohort) else Job.user_id
    return list(session.scalars(select(Job).where(column == owner.id, Job.private).order_by(Job.id)))


def private_parts_of(session: Session, user_id: int) -> list[Row[Any]]:
    """The round parts of private federated jobs the user's devices took, oldest first, as (job id, job spec, round
    index, part status): entries of the user's privacy ledger too (a part leased may have touched data, whatever
    became of it)."""
    return list(
        session.execute(
            select(Job.id, Job.spec, Round.index, RoundClient.status)
            .join(Round, Round.job_id == Job.id)
            .join(RoundClient, RoundClient.round_id == Round.id)
            .where(RoundClient.user_id == user_id, Job.private)
            .order_by(RoundClient.id)
        )
    )


def server_key(session: Session, name: str) -> str | None:
    """One of the server's own secrets (``tables.ServerKey``; made by ``accounts.server_key``), or None."""
    return session.scalar(select(ServerKey.value).where(ServerKey.name == name))


def web_session(session: Session, token_hash: str) -> WebSession | None:
    """The dashboard session a cookie names, unless it expired."""
    return session.scalar(
        select(WebSession).where(WebSession.token_hash == token_hash, WebSession.expires_at > utcnow())
    )


def users(session: Session) -> list[Row[Any]]:
    """Every user with counts of their devices and jobs, by id: (user, devices, jobs)."""
    devices = select(func.count(Device.id)).where(Device.user_id == User.id).scalar_subquery()
    jobs = select(func.count(Job.id)).where(Job.user_id == User.id).scalar_subquery()
    return list(session.execute(select(User, devices, jobs).order_by(User.id)).all())


def jobs_by_status(conn: Connection | Session) -> dict[str, int]:
    """How many jobs are in each status (statuses with none are absent)."""
    return dict(conn.execute(select(Job.status, func.count(Job.id)).group_by(Job.status)).all())


def active_leases(conn: Connection | Session) -> dict[str, int]:
    """Leases held now: running jobs and leased round parts."""
    jobs = conn.execute(select(func.count(Job.id)).where(Job.status == "running")).scalar_one()
    parts = conn.execute(select(func.count(RoundClient.id)).where(RoundClient.status == "leased")).scalar_one()
    return {"job": jobs, "round": parts}


def device_work(session: Session, device_ids: list[int]) -> dict[int, list[int]]:
    """The jobs each of the devices holds a lease on now: device id → job ids."""
    rows = session.execute(
        select(Job.leased_device_id, Job.id).where(Job.status == "running", Job.leased_device_id.in_(device_ids))
    ).all()
    work: dict[int, list[int]] = {}
    for device_id, job_id in rows:
        work.setdefault(device_id, []).append(job_id)
    return work
