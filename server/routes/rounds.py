"""A device's part in a federated round (``/v1/round-clients/{id}/…``) and the admin's view of a job's rounds.

A round lease (``POST /v1/leases`` answering with ``round`` set) names a round client; its device downloads the
cached program, weights, tokenizer and B_r (``init``) by content (``GET /v1/blobs/{sha256}``), heartbeats here, and
uploads its log alone
(``POST /v1/round-clients/{id}/result``: multipart ``log`` and ``metrics``). The server replays the log from B_r
in a verify worker and records the client's B; the K-th report closes the round (``server.federation``). An
upload after the round closed, or after the client's lease ran out, answers 409. Only the device holding the part
sees any of it (404 for anyone else).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Annotated

from fastapi import Depends, HTTPException, Request, Response, status
from sqlalchemy.orm import Session

from server import federation, jobstate, metrics, queries
from server.deps import (
    AdminDep,
    CurrentDevice,
    ObjectId,
    SessionDep,
    SettingsDep,
    StoreDep,
    UploadSlotsDep,
    VerifyPoolDep,
)
from server.limits import ROUND_UPLOAD, upload_body_limit
from server.responses import errors, not_found
from server.router import Router
from server.tables import Job, Round, RoundClient, utcnow
from server.uploads import BodyPace, receive, received_parts, refuse_while_verifying, run_verification
from server.verify import METRICS_LIMIT, log_limit, replay_log_only
from shared.schemas import (
    HeartbeatCreate,
    HeartbeatPublic,
    JobFailureCreate,
    RoundClientPublic,
    RoundPublic,
    RoundReportPublic,
    RoundsPublic,
)

router = Router(tags=["rounds"])
LOG_PARTS = ("log", "metrics")
LOG_BODY = {
    "required": True,
    "content": {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "required": list(LOG_PARTS),
                "properties": {
                    "log": {"type": "string", "format": "binary", "description": "training log, JSON Lines"},
                    "metrics": {"type": "string", "format": "binary", "description": "metrics.json"},
                },
            }
        }
    },
}


def get_device_client(client_id: ObjectId, device: CurrentDevice, session: SessionDep) -> RoundClient:
    """The round client of the path if this device holds it; 404 for anyone else's."""
    client = session.get(RoundClient, client_id)
    session.commit()
    if client is None or client.device_id != device.id:
        raise not_found("round client")
    return client


DeviceClient = Annotated[RoundClient, Depends(get_device_client)]


def _job(session: Session, client: RoundClient) -> tuple[Round, Job]:
    round_ = session.get_one(Round, client.round_id)
    return round_, session.get_one(Job, round_.job_id)


_CLIENT = "/v1/round-clients/{client_id}"


@router.post(f"{_CLIENT}/heartbeat", response_model=HeartbeatPublic, responses=errors(400, 401, 403, 404, 413, 422))
def heartbeat(client: DeviceClient, body: HeartbeatCreate, session: SessionDep, settings: SettingsDep):
    """Extends the client's lease; ``cancelled: true`` once its part is over (the round closed without it, its
    lease ran out, or the job ended): the device stops and forgets it."""
    metrics.HEARTBEATS.labels("round").inc()
    expires = jobstate.client_heartbeat(session, client, settings.lease_s, body.step)
    job = _job(session, client)[1]
    session.commit()
    if expires is None:
        return HeartbeatPublic(cancelled=True, status=job.status, expires_at=utcnow())
    return HeartbeatPublic(cancelled=False, status=job.status, expires_at=expires)


@router.post(
    f"{_CLIENT}/fail",
    status_code=status.HTTP_204_NO_CONTENT,
    responses=errors(400, 401, 403, 404, 409, 413, 422, e409="this part of the round is over"),
)
def fail(client: DeviceClient, body: JobFailureCreate, session: SessionDep) -> Response:
    """The device gives up its part (bad local data, say): the slot is free for another device."""
    if not jobstate.client_gave_up(session, client):
        raise HTTPException(status.HTTP_409_CONFLICT, f"round client {client.id}: its part is over")
    return Response(status_code=status.HTTP_204_NO_CONTENT)


def _late(client: RoundClient) -> HTTPException:
    return HTTPException(
        status.HTTP_409_CONFLICT, f"round client {client.id}: the round closed or its lease ran out (late upload)"
    )


@router.post(
    ROUND_UPLOAD,
    status_code=status.HTTP_201_CREATED,
    response_model=RoundReportPublic,
    responses=errors(
        401,
        403,
        404,
        408,
        409,
        413,
        422,
        429,
        503,
        e409="the round closed, or this client's lease ran out: a late upload",
        e422="a part is missing or malformed, or the log is not a valid log of this round's part",
    ),
    openapi_extra={"requestBody": LOG_BODY},
)
def upload_log(
    client: DeviceClient,
    session: SessionDep,
    settings: SettingsDep,
    store: StoreDep,
    pool: VerifyPoolDep,
    slots: UploadSlotsDep,
    request: Request,
) -> RoundReportPublic:
    """Multipart ``log`` and ``metrics``; the log is checked and replayed from B_r (no B is uploaded)."""
    round_, job = _job(session, client)
    if not jobstate.client_is_open(client, round_):
        raise _late(client)
    ctx = federation.replay_context(session, job, client)
    init = store.adapter_b(round_.b_sha256)
    spec = federation.client_spec(job, client)  # upload: log, as every round part
    session.commit()
    refuse_while_verifying(pool, client.user_id)
    slot = partial(slots.hold, client.device_id, client.user_id)  # taken when the body starts to arrive
    limit = upload_body_limit(log_limit(spec), METRICS_LIMIT)
    with received_parts(request, store, limit, LOG_PARTS, (), BodyPace.of(settings), slot) as (parts, tmp):
        log_path = receive(store, tmp, spec, 0, parts).log_path
        outcome = run_verification(
            pool, settings, client.user_id, replay_log_only, ctx, str(log_path), str(init), str(tmp)
        )
        b_sha = store.keep(Path(outcome["b_flat"]), "adapters", ".safetensors")[1]
        log_sha = store.keep(log_path, "logs", ".jsonl")[1]
        report = {
            "log_sha256": log_sha,
            "b_sha256": b_sha,
            "mean_loss": outcome["mean_loss"],
            "replay_s": outcome["replay_s"],
            "log_bytes": store.log(log_sha).stat().st_size,
        }
        if not jobstate.client_reported(session, client, report):
            raise _late(client)
    federation.close_if_full(session, store, pool, settings, client)
    return RoundReportPublic(client_id=client.id, round=round_.index, b_sha256=b_sha)


def _client_public(client: RoundClient) -> RoundClientPublic:
    return RoundClientPublic.model_validate(client, from_attributes=True)


@router.get("/v1/jobs/{job_id}/rounds", response_model=RoundsPublic, responses=errors(401, 403, 404, 422))
def list_rounds(job_id: ObjectId, _: AdminDep, session: SessionDep) -> RoundsPublic:
    """A federated job's rounds, each with its clients in aggregation order (admin)."""
    job = session.get(Job, job_id)
    if job is None or job.cohort_id is None:
        raise not_found("federated job")
    data = []
    for round_, clients in queries.rounds_of(session, job.id):
        fields = {name: getattr(round_, name) for name in RoundPublic.model_fields if name != "clients"}
        data.append(RoundPublic(**fields, clients=[_client_public(c) for c in clients]))
    return RoundsPublic(data=data, count=len(data))
