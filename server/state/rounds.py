"""A federated job's rounds (``server.state``'s transaction rule). A federated job (``cohort_id`` set) is ``ready``
until its first client leases round 0, then ``running`` through its rounds, each of which goes

    open → closing → closed (B_{r+1} published; the next round opens, or after the last the job succeeds)
      ↘ reopened once at the timeout with fewer than M reports; at the second timeout: failed (and so is the job)

and each client's part in a round goes leased → reported (its log replayed), or leased → expired (its lease ran
out: the slot is free again). Here the parts; the close and the timeout are ``server.state.closes``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    and_,
    exists,
    func,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from server import accounts
from server.accounts import SeenMemo
from server.db import begin_write
from server.tables import (
    Device,
    DeviceIdentity,
    Job,
    LeasingDevice,
    Round,
    RoundClient,
    utcnow,
)


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
