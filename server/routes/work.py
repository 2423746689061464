"""The work exchange: every leased work item, whatever its kind, is addressed alike.

A lease (``POST /v1/leases``, ``routes/leases.py``) names its work item, ``LeasePublic.work``: ``job-{job id}``
for a personal job, ``part-{round client id}`` for a device's part in a federated round. The device then talks
about it at ``/v1/work/{work}/``:

- ``heartbeat``: its progress; extends the lease, answers whether to stop;
- ``fail``: it gives the item up, with its reason;
- ``result``: multipart ``log`` and ``metrics``, and ``b_flat`` where the item's ``spec.upload`` is ``b`` (a round
  part's, and a job's with ``upload: log``, is its log alone); verified by replay as the kind of item requires.

Only the device holding an item sees it (404 for anyone else's, or for a name of no item). Each verb is one code
path for every kind: the name is resolved once to its item (``server.work_items``), which says where its lease is
held and what its verified result becomes; results go through one pipeline (``server.results``: read, verify by
replay, publish, record as a job's adapter version or a round part's report). The routes of earlier versions
(``/v1/jobs/{id}/{heartbeat,fail,result}``, ``/v1/round-clients/{id}/…``) answer 410 Gone.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import HTTPException, Path, Request, Response, status

from server import metrics, results
from server.deps import (
    CurrentDevice,
    DeviceId,
    EngineDep,
    RoundSweepDep,
    SeenDep,
    SessionDep,
    SettingsDep,
    StoreDep,
    UploadSlotsDep,
    VerifyPoolDep,
)
from server.limits import WORK_UPLOAD
from server.responses import errors
from server.router import Router
from server.work_items import work_item
from shared.schemas import (
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
    seen: SeenDep,
) -> HeartbeatPublic:
    """The item's progress; extends the lease and says whether to stop (``cancelled: true``: forget the item)."""
    item = work_item(work)
    metrics.HEARTBEATS.labels(item.kind).inc()
    answer = item.extend(engine, session, device, settings.lease_s, body, seen)
    return answer if answer is not None else item.refused(engine, session, device, body)


@router.post(
    "/v1/work/{work}/fail",
    status_code=status.HTTP_204_NO_CONTENT,
    responses=errors(400, 401, 403, 404, 409, 413, 422, e409="this device no longer holds the item"),
)
def fail(work: WorkName, body: JobFailureCreate, device: CurrentDevice, session: SessionDep) -> Response:
    """Give up the item with the device's reason: a job fails with it; a round part's slot goes to another device."""
    over = work_item(work).give_up(session, device, body.error)
    if over is not None:
        raise HTTPException(status.HTTP_409_CONFLICT, over)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


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
    item = work_item(work).admit(session, store, device, round_sweep.set)
    return results.upload(item, device, session, settings, store, pool, slots, request, response)


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
