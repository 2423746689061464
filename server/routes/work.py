"""The work exchange: every leased work item, whatever its kind, is addressed alike.

A lease (``POST /v1/leases``, ``routes/leases.py``) names its work item, ``LeasePublic.work``: ``job-{job id}``
for a personal job, ``part-{round client id}`` for a device's part in a federated round. The device then talks
about it at ``/v1/work/{work}/``:

- ``heartbeat``: its progress; extends the lease, answers whether to stop;
- ``fail``: it gives the item up, with its reason;
- ``result``: multipart ``log`` and ``metrics``, and ``b_flat`` where the item's ``spec.upload`` is ``b`` (a round
  part's, and a job's with ``upload: log``, is its log alone); verified by replay as the kind of item requires.

Only the device holding an item sees it (404 for anyone else's, or for a name of no item). Heartbeats and failures
of both kinds are here; results are checked by ``server.results`` (a job's B by replay and its adapter version, a
round part's log by replay from B_r). The routes of earlier versions
(``/v1/jobs/{id}/{heartbeat,fail,result}``, ``/v1/round-clients/{id}/…``) answer 410 Gone.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import HTTPException, Path, Request, Response, status
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from server import jobstate, metrics, queries, results
from server.db import read_only
from server.deps import (
    CurrentDevice,
    DeviceId,
    EngineDep,
    RoundSweepDep,
    SessionDep,
    SettingsDep,
    StoreDep,
    UploadSlotsDep,
    VerifyPoolDep,
    device_job,
    revoked,
)
from server.limits import WORK_UPLOAD
from server.responses import errors, field_error, not_found
from server.router import Router
from server.settings import Settings
from server.tables import Device, DeviceIdentity, Job, RoundClient, utcnow
from shared.schemas import (
    MAX_DB_INT,
    RESULT_PARTS,
    WORK_NAME,
    HeartbeatCreate,
    HeartbeatPublic,
    JobFailureCreate,
    ResultPublic,
    RoundReportPublic,
)

router = Router(tags=["work"])
WorkName = Annotated[
    str,
    Path(pattern=WORK_NAME, description="the leased work item: job-{job id}, or part-{round client id}"),
]
WORK_BODY = {
    "required": True,
    "content": {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "required": [part for part in RESULT_PARTS if part != "b_flat"],
                "properties": {
                    "b_flat": {
                        "type": "string",
                        "format": "binary",
                        "description": "safetensors with one float32 tensor b_flat [D]; only where spec.upload is b",
                    },
                    "log": {"type": "string", "format": "binary", "description": "training log, JSON Lines"},
                    "metrics": {"type": "string", "format": "binary", "description": "metrics.json"},
                },
            }
        }
    },
}


def parse_work(work: str) -> tuple[str, int]:
    """``job-12`` → ``("job", 12)``; 422 for an id past the ids' range, as every id in a path."""
    kind, _, number = work.partition("-")
    if int(number) > MAX_DB_INT:
        raise field_error("work", f"the id must be at most {MAX_DB_INT}", where="path")
    return kind, int(number)


def _device_client(session: Session, client_id: int, device_id: int) -> RoundClient:
    """The round client ``client_id`` if this device holds it; 404 for anyone else's."""
    client = session.get(RoundClient, client_id)
    if client is None or client.device_id != device_id:
        raise not_found("round client")
    return client


def _job_heartbeat(
    job_id: int, body: HeartbeatCreate, device: DeviceIdentity, engine: Engine, settings: Settings
) -> HeartbeatPublic:
    """A leased job's progress (``POST /v1/work/job-{id}/heartbeat``): extends the lease and says whether to
    stop."""
    metrics.HEARTBEATS.labels("job").inc()
    expires = jobstate.heartbeat(engine, job_id, device, settings.lease_s, body)
    if expires is not None:
        return HeartbeatPublic(cancelled=False, status="running", expires_at=expires)
    with read_only(engine) as conn:  # it did not apply: say why
        job, gone = queries.heartbeat_refusal(conn, job_id, device.id)
    if gone is not None:
        raise revoked(device.id)
    if job is None or job.user_id != device.user_id:
        raise not_found("job")
    if job.status == "cancelled" and job.leased_device_id == device.id:
        return HeartbeatPublic(cancelled=True, status="cancelled", expires_at=utcnow())
    if jobstate.holds_lease(job, device.id) and body.step > job.spec["steps"]:
        raise field_error("step", f"must not exceed the job's {job.spec['steps']} steps")
    if jobstate.holds_lease(job, device.id) and body.loss is not None and job.spec.get("privacy"):
        raise field_error("loss", "a private job's heartbeat carries no loss: its losses stay on the device")
    raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id}: this device does not hold its lease (expired?)")


def _job_fail(job: Job, body: JobFailureCreate, device: Device, session: Session) -> Response:
    """Give up a leased job with the device's reason (``POST /v1/work/job-{id}/fail``); the job fails with it."""
    if not jobstate.device_failed(session, job, device, body.error):
        raise HTTPException(status.HTTP_409_CONFLICT, f"job {job.id}: this device holds no lease on it")
    return Response(status_code=status.HTTP_204_NO_CONTENT)


def _part_heartbeat(
    client: RoundClient, body: HeartbeatCreate, device: DeviceIdentity, session: Session, settings: Settings
) -> HeartbeatPublic:
    """A round part's progress (``POST /v1/work/part-{id}/heartbeat``): extends the client's lease;
    ``cancelled: true`` once its part is over (the round closed without it, its lease ran out, or the job ended):
    the device stops and forgets it."""
    metrics.HEARTBEATS.labels("round").inc()
    expires = jobstate.client_heartbeat(session, client, device, settings.lease_s, body.step)
    job = results.round_of(session, client)[1]
    if expires is None:
        return HeartbeatPublic(cancelled=True, status=job.status, expires_at=utcnow())
    return HeartbeatPublic(cancelled=False, status=job.status, expires_at=expires)


def _part_fail(client: RoundClient, body: JobFailureCreate, session: Session) -> Response:
    """The device gives up its part (bad local data, say; ``POST /v1/work/part-{id}/fail``): the slot is free for
    another device."""
    if not jobstate.client_gave_up(session, client):
        raise HTTPException(status.HTTP_409_CONFLICT, f"round client {client.id}: its part is over")
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post(
    "/v1/work/{work}/heartbeat",
    response_model=HeartbeatPublic,
    responses=errors(
        400,
        401,
        403,
        404,
        409,
        413,
        422,
        e409="this device does not hold the job's lease",
        e422="malformed, progress beyond the job's steps, or a loss in a private job's heartbeat",
    ),
)
def heartbeat(
    work: WorkName,
    body: HeartbeatCreate,
    device: DeviceId,
    engine: EngineDep,
    session: SessionDep,
    settings: SettingsDep,
) -> HeartbeatPublic:
    """The item's progress; extends the lease and says whether to stop (``cancelled: true``: forget the item)."""
    kind, number = parse_work(work)
    if kind == "job":
        return _job_heartbeat(number, body, device, engine, settings)
    if session.get_one(Device, device.id).revoked_at is not None:  # before the part: 401, whoever's part it names
        raise revoked(device.id)
    client = _device_client(session, number, device.id)
    return _part_heartbeat(client, body, device, session, settings)


@router.post(
    "/v1/work/{work}/fail",
    status_code=status.HTTP_204_NO_CONTENT,
    responses=errors(400, 401, 403, 404, 409, 413, 422, e409="this device no longer holds the item"),
)
def fail(work: WorkName, body: JobFailureCreate, device: CurrentDevice, session: SessionDep) -> Response:
    """Give up the item with the device's reason: a job fails with it; a round part's slot goes to another device."""
    kind, number = parse_work(work)
    if kind == "job":
        return _job_fail(device_job(session, number, device), body, device, session)
    return _part_fail(_device_client(session, number, device.id), body, session)


@router.post(
    WORK_UPLOAD,
    status_code=status.HTTP_201_CREATED,
    response_model=ResultPublic | RoundReportPublic,
    responses={
        200: {"model": ResultPublic, "description": "the same result of a job was uploaded before"},
        **errors(
            401,
            403,
            404,
            408,
            409,
            413,
            422,
            429,
            503,
            e409="the item is over (a job cancelled or holding a different result, a round closed) or its lease lost",
            e413="the body, or a part, is larger than the item allows",
            e422="a part is missing or malformed, or the log does not replay to the uploaded B",
            e429="too many uploads in progress (from this device or user, or in all), or this user's devices already "
            "have results being verified; retry after Retry-After seconds",
            e503="verification ran past its timeout or its worker died; retry after Retry-After seconds",
        ),
    },
    openapi_extra={"requestBody": WORK_BODY},
)
def result(
    work: WorkName,
    device: CurrentDevice,
    session: SessionDep,
    settings: SettingsDep,
    store: StoreDep,
    pool: VerifyPoolDep,
    slots: UploadSlotsDep,
    request: Request,
    response: Response,
    round_sweep: RoundSweepDep,
) -> ResultPublic | RoundReportPublic:
    """The item's result, checked in order: the token, the item and its lease, the sizes, then the content by
    replay (nothing of the body is read before the lease is checked). A job answers its adapter version; a round
    part, the B its log replays to."""
    kind, number = parse_work(work)
    if kind == "job":
        job = device_job(session, number, device)
        return results.upload_result(job, device, session, settings, store, pool, slots, request, response)
    client = _device_client(session, number, device.id)
    return results.part_upload(client, session, settings, store, pool, slots, request, round_sweep.set)


RETIRED = (
    "/v1/jobs/{job_id}/heartbeat",
    "/v1/jobs/{job_id}/fail",
    "/v1/jobs/{job_id}/result",
    "/v1/round-clients/{client_id}/heartbeat",
    "/v1/round-clients/{client_id}/fail",
    "/v1/round-clients/{client_id}/result",
)
router.retire(
    RETIRED,
    "POST",
    "this route was retired: a lease's work goes to /v1/work/{work}/{heartbeat,fail,result} (the lease's "
    "work_path); upgrade the device agent",
)
