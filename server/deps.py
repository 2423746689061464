"""Request dependencies: a DB session, the settings, the store and worker pools, who is calling (admin, user or
device), and the job a device's work item names (``device_job``).

A revoked device's token is refused (401) by every route that takes a device: ``get_current_device`` reads the
row; the two routes on the token cache (``get_device_identity``: lease and heartbeat) test the row in the
transaction they run anyway.

Routes declare only what they need: ``session: SessionDep``, ``user: CurrentUser``, ``device: CurrentDevice``,
``_: AdminDep``. A bad or missing token is 401; a valid token of the wrong kind is 403.

A request's session reads in autocommit (``server.db``): FastAPI runs each sync dependency and the route in
separate thread-pool calls, and what a dependency read holds no transaction (on SQLite, no write lock) while
the route waits for a thread. Writes are the state layer's transitions, each its own unit of work (a device
heard from: ``accounts.heard_from``). Plain getters are ``async`` so that they need no thread at all.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, HTTPException, Path, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import Engine, bindparam, select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from server.accounts import SeenMemo, heard_from, seen_is_due
from server.compile_queue import CompileQueue
from server.db import read_only
from server.limits import UploadSlots
from server.lru import LRUCache
from server.merged_builds import MergedBuilds
from server.pace import Pace
from server.pool import WorkerPool
from server.privacy import Accountant
from server.responses import not_found
from server.security import DEVICE_TOKEN, USER_KEY, constant_time_equal, parse_token, secret_matches
from server.settings import Settings
from server.store import ArtifactStore
from server.tables import Device, DeviceIdentity, Job, User
from shared.manifest import InferenceManifest, ProgramManifest
from shared.schemas import MAX_DB_INT, JobCreate

_bearer = HTTPBearer(auto_error=False, description="admin token, user API key or device token")


async def get_session(request: Request) -> AsyncIterator[Session]:
    """A session per request, opened and closed on the event loop: neither does I/O here. It reads in autocommit
    (``server.db``), so however long the request takes with what it read (a dashboard page drawing its charts, an
    upload arriving), no writer waits on it; it writes only in the state layer's transitions, which commit
    themselves (``server.router`` refuses an endpoint that leaves one open). As a sync generator it cost two
    thread-pool hops per request, more than the work."""
    with request.app.state.sessionmaker() as session:
        yield session


async def get_engine(request: Request) -> Engine:
    return request.app.state.engine


async def get_settings_dep(request: Request) -> Settings:
    return request.app.state.settings


async def get_store(request: Request) -> ArtifactStore:
    return request.app.state.store


async def get_pace(request: Request) -> Pace:
    return request.app.state.pace


async def get_seen(request: Request) -> SeenMemo:
    return request.app.state.seen


async def get_queue(request: Request) -> CompileQueue:
    return request.app.state.compile_queue


async def get_verify_pool(request: Request) -> WorkerPool:
    return request.app.state.verify_pool


async def get_program_manifests(request: Request) -> LRUCache[int, ProgramManifest | InferenceManifest]:
    """The programs' manifests as devices get them, by program id (``server.grants.device_manifest``)."""
    return request.app.state.program_manifests


async def get_job_specs(request: Request) -> LRUCache[int, JobCreate]:
    """Jobs' specs as parsed for their public shape, by job id (``server.views.job_spec``)."""
    return request.app.state.job_specs


async def get_upload_slots(request: Request) -> UploadSlots:
    return request.app.state.upload_slots


async def get_accountant(request: Request) -> Accountant:
    return request.app.state.accountant


async def get_merged_builds(request: Request) -> MergedBuilds:
    return request.app.state.merged_builds


async def get_round_sweep(request: Request) -> threading.Event:
    """Set it and the round sweeper runs now (``server.app``): a report that filled its round."""
    return request.app.state.round_sweep


SessionDep = Annotated[Session, Depends(get_session)]
EngineDep = Annotated[Engine, Depends(get_engine)]
SettingsDep = Annotated[Settings, Depends(get_settings_dep)]
StoreDep = Annotated[ArtifactStore, Depends(get_store)]
PaceDep = Annotated[Pace, Depends(get_pace)]
SeenDep = Annotated[SeenMemo, Depends(get_seen)]
QueueDep = Annotated[CompileQueue, Depends(get_queue)]
VerifyPoolDep = Annotated[WorkerPool, Depends(get_verify_pool)]
UploadSlotsDep = Annotated[UploadSlots, Depends(get_upload_slots)]
AccountantDep = Annotated[Accountant, Depends(get_accountant)]
MergedBuildsDep = Annotated[MergedBuilds, Depends(get_merged_builds)]
RoundSweepDep = Annotated[threading.Event, Depends(get_round_sweep)]
JobSpecsDep = Annotated[LRUCache[int, JobCreate], Depends(get_job_specs)]
ProgramManifestsDep = Annotated[LRUCache[int, ProgramManifest | InferenceManifest], Depends(get_program_manifests)]
ObjectId = Annotated[int, Path(ge=1, le=MAX_DB_INT, description="an id (ids are positive 32-bit integers)")]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def _unauthorized(reason: str) -> HTTPException:
    return HTTPException(status.HTTP_401_UNAUTHORIZED, reason, headers={"WWW-Authenticate": "Bearer"})


def _token(credentials: HTTPAuthorizationCredentials | None) -> str:
    if credentials is None:
        raise _unauthorized("missing bearer token (Authorization: Bearer ...)")
    return credentials.credentials


def _is_admin(token: str, settings: Settings) -> bool:
    return settings.admin_token is not None and constant_time_equal(token, settings.admin_token)


def _wrong_kind(token: str, settings: Settings, wanted: str) -> HTTPException:
    """403 for a valid-looking token of another kind (the caller knows which kind it holds), else 401."""
    if _is_admin(token, settings) or parse_token(token) is not None:
        return HTTPException(status.HTTP_403_FORBIDDEN, f"this endpoint needs a {wanted}")
    return _unauthorized("invalid token")


def require_admin(credentials: Credentials, settings: SettingsDep) -> None:
    token = _token(credentials)
    if not _is_admin(token, settings):
        raise _wrong_kind(token, settings, "admin token")


def get_current_user(credentials: Credentials, session: SessionDep, settings: SettingsDep) -> User:
    token = _token(credentials)
    parsed = parse_token(token)
    if parsed is None or parsed[0] != USER_KEY:
        raise _wrong_kind(token, settings, "user API key")
    user = session.get(User, parsed[1])
    if not secret_matches(parsed[2], None if user is None else user.key_hash):  # the same work for an unknown id
        raise _unauthorized("invalid token")
    return user


def _device_token(credentials: HTTPAuthorizationCredentials | None, settings: Settings) -> tuple[int, str]:
    """(device id, secret) of a device token; 401/403 for anything else."""
    token = _token(credentials)
    parsed = parse_token(token)
    if parsed is None or parsed[0] != DEVICE_TOKEN:
        raise _wrong_kind(token, settings, "device token")
    return parsed[1], parsed[2]


def get_current_device(credentials: Credentials, session: SessionDep, settings: SettingsDep) -> Device:
    device_id, secret = _device_token(credentials, settings)
    device = session.get(Device, device_id)
    valid = secret_matches(secret, None if device is None else device.token_hash)  # the same work for an unknown id
    if valid and device.revoked_at is None and seen_is_due(device.last_seen_at):
        heard_from(session, DeviceIdentity(device.id, device.user_id))
    if not valid:
        raise _unauthorized("invalid token")
    if device.revoked_at is not None:
        raise revoked(device_id)
    return device


def revoked(device_id: int) -> HTTPException:
    """401 for a revoked device's token: the agent stops asking (``device_agent``) and says why."""
    return _unauthorized(f"device {device_id} was revoked; enroll it again with a new code")


_DEVICE = select(Device.token_hash, Device.user_id).where(Device.id == bindparam("id"))  # built once


def _read_device(engine: Engine, device_id: int) -> tuple[str, int] | None:
    with read_only(engine) as conn:
        row = conn.execute(_DEVICE, {"id": device_id}).first()
    return None if row is None else (row.token_hash, row.user_id)


async def get_device_identity(request: Request, credentials: Credentials, settings: SettingsDep) -> DeviceIdentity:
    """The device a token names (401/403 as ``get_current_device``), from this process's cache of device tokens
    (``server.lru``: a device's token hash and user never change), so that a heartbeat's token check costs no
    database read and no thread-pool hop; the first request of a device reads its row in a worker thread.

    Every rejection costs the same: a row read in a worker thread and a hash comparison, whether the id is unknown
    (compared with no hash: ``secret_matches``) or known with a wrong secret (the cache's hash did not match: the
    row is read again). Were a wrong secret refused from the cache alone, the answer's time would tell the ids of
    enrolled devices from the rest."""
    device_id, secret = _device_token(credentials, settings)
    tokens: LRUCache[int, tuple[str, int]] = request.app.state.device_tokens
    known = tokens.get(device_id)
    if known is not None and secret_matches(secret, known[0]):
        return DeviceIdentity(device_id, known[1])
    row = await run_in_threadpool(_read_device, request.app.state.engine, device_id)
    if row is not None:
        tokens.put(device_id, row)
    if not secret_matches(secret, None if row is None else row[0]):
        raise _unauthorized("invalid token")
    return DeviceIdentity(device_id, row[1])


def require_any(credentials: Credentials, session: SessionDep, settings: SettingsDep) -> None:
    """Admin, user or device: for reading shared, non-secret lists such as the registered models."""
    token = _token(credentials)
    if _is_admin(token, settings):
        return
    parsed = parse_token(token)
    if parsed is not None and parsed[0] == USER_KEY:
        get_current_user(credentials, session, settings)
    elif parsed is not None and parsed[0] == DEVICE_TOKEN:
        get_current_device(credentials, session, settings)
    else:
        raise _unauthorized("invalid token")


def get_user_or_admin(credentials: Credentials, session: SessionDep, settings: SettingsDep) -> User | None:
    """A user (their ``User``) or the admin (None): for cohorts and federated jobs, which both see."""
    token = _token(credentials)
    if _is_admin(token, settings):
        return None
    return get_current_user(credentials, session, settings)


AdminDep = Annotated[None, Depends(require_admin)]
UserOrAdmin = Annotated[User | None, Depends(get_user_or_admin)]
CurrentUser = Annotated[User, Depends(get_current_user)]
CurrentDevice = Annotated[Device, Depends(get_current_device)]
DeviceId = Annotated[DeviceIdentity, Depends(get_device_identity)]
AnyAuth = Annotated[None, Depends(require_any)]


def device_job(session: Session, job_id: int, device: Device) -> Job:
    """The job ``job_id`` if it belongs to the device's user; 404 for anyone else's."""
    job = session.get(Job, job_id)
    if job is None or job.user_id != device.user_id:
        raise not_found("job")
    return job
