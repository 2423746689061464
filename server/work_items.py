"""A leased work item, resolved once from its name (``work_item``): ``job-{job id}``, a personal job, or
``part-{round client id}``, a device's part in a federated round. The work exchange (``routes/work.py``) takes
every item through the same steps; the item answers where its lease is held (the job's row, or the round
client's), why a heartbeat did not apply, and what its verified result becomes (``server.results``: an adapter
version, or a round part's report).

An item is only its device's: a name of no item, or of another user's job or another device's part, is 404.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol

from fastapi import HTTPException, status
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from server import queries, results
from server.accounts import SeenMemo
from server.db import read_only
from server.deps import device_job, revoked
from server.responses import field_error, not_found
from server.state import jobs, leases, rounds
from server.store import ArtifactStore
from server.tables import Device, DeviceIdentity, RoundClient, utcnow
from shared.schemas import MAX_DB_INT, HeartbeatCreate, HeartbeatPublic


class WorkItem(Protocol):
    """What every verb of the work exchange asks of an item, whatever its kind."""

    kind: ClassVar[str]  # its metrics' label
    id: int

    def extend(
        self,
        engine: Engine,
        session: Session,
        device: DeviceIdentity,
        lease_s: int,
        progress: HeartbeatCreate,
        seen: SeenMemo,
    ) -> HeartbeatPublic | None:
        """A heartbeat: extend the lease the device holds and record its progress (and the device as seen, when
        ``seen`` says it is due) → the answer; None when the heartbeat did not apply (``refused`` says why)."""

    def refused(
        self, engine: Engine, session: Session, device: DeviceIdentity, progress: HeartbeatCreate
    ) -> HeartbeatPublic:
        """Why a heartbeat did not apply, read after the fact: 401, 404, 409 or 422, or the answer that tells the
        device to stop (``cancelled: true``)."""

    def give_up(self, session: Session, device: Device, error: str) -> str | None:
        """The device gives the item up with its reason → None, or why it could not (it holds the item no more)."""

    def admit(
        self, session: Session, store: ArtifactStore, device: Device, close_soon: Callable[[], None]
    ) -> results.ItemResult:
        """Before a byte of a result's body is read: what the upload is checked against (404/409 if it may not)."""


def work_item(work: str) -> WorkItem:
    """``job-12`` → ``JobItem(12)``; 422 for an id past the ids' range, as every id in a path (the name's form is
    the route's pattern, ``shared.schemas.WORK_NAME``)."""
    kind, _, number = work.partition("-")
    if int(number) > MAX_DB_INT:
        raise field_error("work", f"the id must be at most {MAX_DB_INT}", where="path")
    return JobItem(int(number)) if kind == "job" else PartItem(int(number))


@dataclass(frozen=True)
class JobItem:
    """A personal job: its lease is the job's; its verified result becomes the job's next adapter version."""

    id: int
    kind: ClassVar[str] = "job"

    def extend(
        self,
        engine: Engine,
        session: Session,
        device: DeviceIdentity,
        lease_s: int,
        progress: HeartbeatCreate,
        seen: SeenMemo,
    ) -> HeartbeatPublic | None:
        expires = leases.heartbeat(engine, self.id, device, lease_s, progress, seen)  # no session: the hot path
        return None if expires is None else HeartbeatPublic(cancelled=False, status="running", expires_at=expires)

    def refused(
        self, engine: Engine, session: Session, device: DeviceIdentity, progress: HeartbeatCreate
    ) -> HeartbeatPublic:
        with read_only(engine) as conn:
            job, gone = queries.heartbeat_refusal(conn, self.id, device.id)
        if gone is not None:
            raise revoked(device.id)
        if job is None or job.user_id != device.user_id:
            raise not_found("job")
        if job.status == "cancelled" and job.leased_device_id == device.id:
            return HeartbeatPublic(cancelled=True, status="cancelled", expires_at=utcnow())
        if jobs.holds_lease(job, device.id) and progress.step > job.spec["steps"]:
            raise field_error("step", f"must not exceed the job's {job.spec['steps']} steps")
        if jobs.holds_lease(job, device.id) and progress.loss is not None and job.spec.get("privacy"):
            raise field_error("loss", "a private job's heartbeat carries no loss: its losses stay on the device")
        raise HTTPException(status.HTTP_409_CONFLICT, f"job {self.id}: this device does not hold its lease (expired?)")

    def give_up(self, session: Session, device: Device, error: str) -> str | None:
        """The job fails with the device's reason."""
        if leases.device_failed(session, device_job(session, self.id, device), device, error):
            return None
        return f"job {self.id}: this device holds no lease on it"

    def admit(
        self, session: Session, store: ArtifactStore, device: Device, close_soon: Callable[[], None]
    ) -> results.JobResult:
        return results.JobResult(session, store, device_job(session, self.id, device), device)


@dataclass(frozen=True)
class PartItem:
    """A device's part in a federated round: its lease is the round client's; its verified result becomes the
    part's report, which the round's close aggregates (``server.federation``)."""

    id: int
    kind: ClassVar[str] = "round"

    def _client(self, session: Session, device_id: int) -> RoundClient | None:
        client = session.get(RoundClient, self.id)
        return client if client is not None and client.device_id == device_id else None

    def extend(
        self,
        engine: Engine,
        session: Session,
        device: DeviceIdentity,
        lease_s: int,
        progress: HeartbeatCreate,
        seen: SeenMemo,
    ) -> HeartbeatPublic | None:
        client = self._client(session, device.id)
        if client is None:
            return None
        expires = rounds.client_heartbeat(session, client, device, lease_s, progress.step, seen)
        if expires is None:
            return None
        return HeartbeatPublic(cancelled=False, status=results.round_of(session, client)[1].status, expires_at=expires)

    def refused(
        self, engine: Engine, session: Session, device: DeviceIdentity, progress: HeartbeatCreate
    ) -> HeartbeatPublic:
        """401 for a revoked device, whoever's part it names; 404 for another's; else the part is over (its round
        closed without it, its lease ran out, or the job ended): the device stops and forgets it."""
        if session.get_one(Device, device.id).revoked_at is not None:
            raise revoked(device.id)
        client = self._held(session, device.id)
        return HeartbeatPublic(cancelled=True, status=results.round_of(session, client)[1].status, expires_at=utcnow())

    def _held(self, session: Session, device_id: int) -> RoundClient:
        client = self._client(session, device_id)
        if client is None:
            raise not_found("round client")
        return client

    def give_up(self, session: Session, device: Device, error: str) -> str | None:
        """The part's slot is free for another device (the reason is the device's to log: bad local data, say)."""
        if rounds.client_gave_up(session, self._held(session, device.id)):
            return None
        return f"round client {self.id}: its part is over"

    def admit(
        self, session: Session, store: ArtifactStore, device: Device, close_soon: Callable[[], None]
    ) -> results.PartResult:
        return results.PartResult(session, store, self._held(session, device.id), close_soon)
