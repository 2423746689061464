"""Who and what the service knows: users, enrollment codes, devices, base models, cohorts and their members,
the dashboard's signed-in browsers. With
``server.state`` (jobs and rounds) this is the server's state layer: routes call these functions and write
nothing themselves (``tests/server/test_structure.py``).

Transaction rule (``server.state``'s): each function here opens its unit of work (``server.db.begin_write``) and
commits it, so a route's write is all or nothing; the steps of a device's lease or heartbeat (``as_reported``,
``record_seen``, ``claim_privacy_ledger``) say so and leave the commit to their caller, which writes them with the
lease, the heartbeat or the job. A name taken by a concurrent request is a
``Taken`` (the unique index decides, not a read before the insert), which routes answer with 409.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, bindparam, delete, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from server import queries
from server.db import begin_write
from server.tables import (
    Cohort,
    CohortMember,
    Device,
    DeviceIdentity,
    EnrollmentCode,
    LeasingDevice,
    Model,
    ServerKey,
    User,
    WebSession,
    utcnow,
)
from shared.schemas import CpuReport

LAST_SEEN_EVERY = timedelta(seconds=30)


class Taken(Exception):
    """The name is taken."""


def _insert(session: Session, row: Any) -> Any:
    """Add ``row`` and commit; ``Taken`` when a unique name is in use (also by a request that raced this one)."""
    begin_write(session)
    session.add(row)
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        raise Taken from None
    return row


def server_key(session: Session, name: str) -> str:
    """One of the server's own secrets (``tables.ServerKey``): the stored one, or a new random one stored by the first
    process that asks (a racing process's insert loses to the primary key, and it reads the winner's)."""
    stored = queries.server_key(session, name)
    if stored is not None:
        return stored
    try:
        _insert(session, ServerKey(name=name, value=secrets.token_hex(32)))
    except Taken:
        pass
    made = queries.server_key(session, name)
    assert made is not None
    return made


def create_user(session: Session, name: str, key_hash: str) -> User:
    return _insert(session, User(name=name, key_hash=key_hash))


def create_enrollment_code(session: Session, user_id: int, code_hash: str, expires_at: datetime) -> EnrollmentCode:
    return _insert(session, EnrollmentCode(user_id=user_id, code_hash=code_hash, expires_at=expires_at))


def enroll_device(session: Session, code_hash: str, token_hash: str, **device: Any) -> Device | None:
    """A new device of the code's user, the code marked used in the same transaction (commits); None (nothing
    written, rolled back) when the code is unknown, expired or used. One conditional UPDATE takes the code, so a
    code enrolls exactly one device."""
    begin_write(session)
    now = utcnow()
    user_id = session.scalar(
        update(EnrollmentCode)
        .where(EnrollmentCode.code_hash == code_hash, EnrollmentCode.used_at.is_(None), EnrollmentCode.expires_at > now)
        .values(used_at=now)
        .returning(EnrollmentCode.user_id)
    )
    if user_id is None:
        session.rollback()
        return None
    return _insert(session, Device(user_id=user_id, token_hash=token_hash, **device))


def cpu_columns(cpu: CpuReport | None) -> dict[str, str | None]:
    """A reported CPU as the device row's columns (both None when not reported)."""
    if cpu is None:
        return {"cpu_arch": None, "cpu_features": None}
    return {"cpu_arch": cpu.arch, "cpu_features": " ".join(cpu.features)}


def as_reported(
    session: Session,
    device: DeviceIdentity,
    backend: str | None,
    memory_mb: int | None,
    cpu: CpuReport | None = None,
) -> tuple[LeasingDevice, datetime | None]:
    """The device with the backend, free memory and CPU it reports now (stored when they changed), else as stored;
    a step of the lease's transaction (the caller commits). Its revocation time comes back as well, for the caller
    to refuse a revoked device: ``(device, revoked_at)``."""
    begin_write(session)
    conn = session.connection()  # the unit's
    stored = conn.execute(
        select(Device.backend, Device.memory_mb, Device.cpu_arch, Device.cpu_features, Device.revoked_at).where(
            Device.id == device.id
        )
    ).one()
    now = {
        "backend": backend or stored.backend,
        "memory_mb": memory_mb if memory_mb is not None else stored.memory_mb,
        **(cpu_columns(cpu) if cpu is not None else {"cpu_arch": stored.cpu_arch, "cpu_features": stored.cpu_features}),
    }
    if stored.revoked_at is None and any(getattr(stored, key) != value for key, value in now.items()):
        conn.execute(update(Device).where(Device.id == device.id).values(**now))
    return LeasingDevice(device.id, device.user_id, now["backend"], now["memory_mb"]), stored.revoked_at


_SEEN = (
    update(Device)
    .where(
        Device.id == bindparam("device"),
        or_(Device.last_seen_at.is_(None), Device.last_seen_at < bindparam("due")),
    )
    .values(last_seen_at=bindparam("now"))
)  # built once


def record_seen(session: Session | Connection, device: DeviceIdentity) -> None:
    """``last_seen_at`` of the device, if it is over 30 s old, in the caller's write transaction (a step of a
    lease or a heartbeat: the caller commits; ``session`` a session, or the connection of a transaction begun on
    the engine): one UPDATE that mostly changes nothing, instead of reading the row first."""
    if isinstance(session, Session):
        begin_write(session)
        session = session.connection()
    now = utcnow()
    session.execute(_SEEN, {"device": device.id, "due": now - LAST_SEEN_EVERY, "now": now})


class SeenMemo:
    """When this process last recorded each device as seen, so that a heartbeat (every few seconds) records it at
    most every ``LAST_SEEN_EVERY`` and issues no statement for it in between: ``due`` before the heartbeat's
    transaction, ``recorded`` once it committed. The memo is this process's; ``record_seen``'s own condition keeps
    the row to one write per interval across processes."""

    def __init__(self, every: timedelta = LAST_SEEN_EVERY, clock: Callable[[], float] = time.monotonic) -> None:
        self._every, self._clock = every.total_seconds(), clock
        self._lock = threading.Lock()
        self._at: dict[int, float] = {}  # device id -> when it was last recorded here
        self._kept = 0  # entries after the last pruning

    def due(self, device_id: int) -> bool:
        at = self._at.get(device_id)
        return at is None or self._clock() - at >= self._every

    def recorded(self, device_id: int) -> None:
        now = self._clock()
        with self._lock:
            self._at[device_id] = now
            if len(self._at) > 2 * self._kept + 1024:  # forget devices whose record is due anyway
                self._at = {key: at for key, at in self._at.items() if now - at < self._every}
                self._kept = len(self._at)


def heard_from(session: Session, device: DeviceIdentity) -> None:
    """A device request's own transition when ``seen_is_due``: ``record_seen``, committed."""
    record_seen(session, device)
    session.commit()


def seen_is_due(last_seen_at: datetime | None) -> bool:
    """Whether to record that a device was heard from: at most every 30 s (a heartbeat should not cost two
    writes)."""
    return last_seen_at is None or utcnow() - last_seen_at > LAST_SEEN_EVERY


def set_privacy_budget(session: Session, owner: User | Cohort, epsilon: float, delta: float) -> None:
    """The budget a user's private jobs, or a cohort's private federated jobs, spend from (``server.privacy``)."""
    begin_write(session)
    owner.privacy_epsilon, owner.privacy_delta = epsilon, delta
    session.commit()


def claim_privacy_ledger(session: Session, owner: User | Cohort, version: int) -> bool:
    """Bump the ledger version of a user or a cohort if it is still ``version`` (the one the ledger was read at);
    False when a racing private submit bumped it first (its job is then part of the ledger). The caller commits,
    with the job."""
    begin_write(session)
    table = type(owner)
    bump = update(table).where(table.id == owner.id, table.privacy_version == version)
    return session.execute(bump.values(privacy_version=version + 1)).rowcount == 1


def register_model(session: Session, **model: Any) -> Model:
    return _insert(session, Model(**model))


def create_cohort(session: Session, name: str, model_id: int, task: str) -> Cohort:
    return _insert(session, Cohort(name=name, model_id=model_id, task=task))


def membership(session: Session, cohort_id: int, user_id: int) -> CohortMember | None:
    return session.scalar(
        select(CohortMember).where(CohortMember.cohort_id == cohort_id, CohortMember.user_id == user_id)
    )


def join_cohort(session: Session, cohort_id: int, user_id: int) -> None:
    """Opt the user in (again); already in: nothing changes. Two joins racing: the unique index keeps one row."""
    begin_write(session)
    row = membership(session, cohort_id, user_id)
    if row is None:
        try:
            _insert(session, CohortMember(cohort_id=cohort_id, user_id=user_id))
        except Taken:  # joined by a request that raced this one
            pass
        return
    if row.left_at is not None:
        row.left_at, row.joined_at = None, utcnow()
    session.commit()


def leave_cohort(session: Session, cohort_id: int, user_id: int) -> None:
    """Opt the user out; not in: nothing changes."""
    begin_write(session)
    session.execute(
        update(CohortMember)
        .where(CohortMember.cohort_id == cohort_id, CohortMember.user_id == user_id, CohortMember.left_at.is_(None))
        .values(left_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    session.commit()


def open_web_session(
    session: Session,
    token_hash: str,
    user_id: int | None,
    csrf_token: str,
    ttl: timedelta,
    keep: int,
    admin_token_hash: str | None = None,
) -> None:
    """A dashboard sign-in (``user_id`` None: the admin, with the hash of the admin token it signed in with),
    valid for ``ttl``. In the same transaction expired rows of anyone are removed, and the user's (or the admin's)
    sessions past their newest ``keep``, this one included, so that signing in again and again adds no rows.
    Commits."""
    begin_write(session)
    now = utcnow()
    session.execute(delete(WebSession).where(WebSession.expires_at < now))
    row = WebSession(
        token_hash=token_hash,
        user_id=user_id,
        csrf_token=csrf_token,
        expires_at=now + ttl,
        admin_token_hash=admin_token_hash,
    )
    session.add(row)
    session.flush()
    owner = WebSession.user_id.is_(None) if user_id is None else WebSession.user_id == user_id
    oldest_kept = session.scalar(
        select(WebSession.id).where(owner).order_by(WebSession.id.desc()).offset(keep - 1).limit(1)
    )
    if oldest_kept is not None:
        session.execute(delete(WebSession).where(owner, WebSession.id < oldest_kept))
    session.commit()


def close_web_session(session: Session, token_hash: str) -> None:
    """Sign out: the cookie's session is gone, whoever holds a copy of the cookie. Commits."""
    begin_write(session)
    session.execute(delete(WebSession).where(WebSession.token_hash == token_hash))
    session.commit()
