"""``POST /v1/jobs/{id}/result``: the device's trained B, its training log and metrics.

Multipart parts (``shared.schemas.RESULT_PARTS``): ``b_flat`` (safetensors, one float32 tensor ``b_flat`` [D]),
``log`` (JSON Lines, one record per step), ``metrics`` (a JSON object). A job submitted with ``upload: log`` takes
no ``b_flat``: the server stores the replay of the log as its B. Checked in order: the token (401/403),
the job and the device's lease (404/409), before a byte of the body is read; then, holding one of the upload slots
(429 when none is free), the sizes (413) while the parts are spooled to a private temporary directory, B's name,
dtype, shape and finiteness, the log's structure and its line count against the job's steps (422), then a worker
replays the log from the starting B and compares (422 if it does not reproduce B: bit for bit, or within
``replay_tolerance`` for devices running eager torch). Only then are the *replayed* B, the log and the PEFT
archive published (temporary name, fsync, rename) and the adapter recorded, in the same transaction that marks the
job succeeded. The same upload again (the same uploaded bytes) answers 200 with the same adapter; a different one
after success is 409.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, NoReturn

from fastapi import HTTPException, Request, Response, status
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from server import jobstate, registry
from server.deps import CurrentDevice, DeviceJob, SessionDep, SettingsDep, StoreDep, UploadSlotsDep, VerifyPoolDep
from server.limits import RESULT_UPLOAD, upload_body_limit
from server.pool import WorkerPool
from server.responses import errors
from server.router import Router
from server.settings import Settings
from server.store import ArtifactStore
from server.tables import Adapter, Device, Job, Model, Program
from server.uploads import BodyPace, Upload, receive, received_parts, refuse_while_verifying, run_verification
from server.verify import (
    METRICS_LIMIT,
    b_limit,
    b_size,
    base_of,
    exact_replay,
    log_limit,
    verify_and_package,
)
from shared.files import sha256_file
from shared.schemas import RESULT_PARTS, JobSpec, ResultPublic

router = Router(tags=["results"])
RESULT_BODY = {
    "required": True,
    "content": {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "required": list(RESULT_PARTS),
                "properties": {
                    "b_flat": {
                        "type": "string",
                        "format": "binary",
                        "description": "safetensors with one float32 tensor b_flat [D]; absent for upload: log",
                    },
                    "log": {"type": "string", "format": "binary", "description": "training log, JSON Lines"},
                    "metrics": {"type": "string", "format": "binary", "description": "metrics.json"},
                },
            }
        }
    },
}


def _context(session: Session, job: Job, device: Device) -> dict[str, Any]:
    """What checking and packaging need to know about the job and the device (plain data, for the worker)."""
    program = session.get_one(Program, job.program_id)
    return {
        "spec": jobstate.device_spec(job).model_dump(mode="json"),
        "manifest": program.manifest,
        "d": b_size(program.manifest),
        **base_of(session.get_one(Model, job.model_id)),
        "exact": exact_replay(device.backend),
    }


def upload_limit(ctx: dict) -> int:
    """The largest multipart body a result of this job can need: its parts' limits and the multipart framing."""
    spec = JobSpec.model_validate(ctx["spec"])
    return upload_body_limit(b_limit(ctx["d"]), log_limit(spec), METRICS_LIMIT)


def _repeat(session: Session, job: Job, upload: Upload) -> ResultPublic | None:
    """The stored result if this upload repeats it (the same uploaded bytes); 409 if the job holds a different one."""
    adapter = registry.job_adapter(session, job.id)
    if adapter is None:
        return None
    uploaded_b = adapter.upload_b_sha256 if upload.b_sha256 is not None else None  # log-only: the log decides
    if (uploaded_b, adapter.log_sha256) != (upload.b_sha256, upload.log_sha256):
        raise HTTPException(status.HTTP_409_CONFLICT, f"job {job.id} already has a different result")
    return ResultPublic(adapter_id=adapter.id, version=adapter.version)


def _publish(store: ArtifactStore, upload: Upload, replayed_b: Path, archive: Path) -> None:
    """Content-addressed, so the same bytes stored before are simply kept. The B stored is the replayed one."""
    store.keep(replayed_b, "adapters", ".safetensors")
    store.keep(upload.log_path, "logs", ".jsonl")
    store.keep(archive, "archives", ".zip")


def _record(
    session: Session, store: ArtifactStore, job: Job, device: Device, ctx: dict, upload: Upload, outcome: dict
) -> ResultPublic:
    """running → succeeded and the new adapter version, in one transaction; files published before commit."""
    archive, archive_sha, archive_size = outcome["archive"]
    replayed_b, replayed_b_sha = outcome["b_flat"]
    spec = ctx["spec"]
    if not jobstate.succeed(session, job, device, spec["steps"]):
        session.rollback()
        session.refresh(job)
        return _repeat(session, job, upload) or _lost(job)
    uploaded_b_sha = upload.b_sha256 or replayed_b_sha  # a log-only upload's B is its replay
    files = registry.StoredFiles(replayed_b_sha, uploaded_b_sha, upload.log_sha256, archive_sha, archive_size)
    checks = dict(outcome["checks"])
    stored = {**upload.metrics, "server": checks}
    if (losses := checks.pop("losses", None)) is not None:  # the verified log's, not the device's claim
        stored["losses"] = losses
    adapter = registry.add_version(session, job, spec, files, stored)
    _publish(store, upload, replayed_b, archive)
    session.commit()
    return ResultPublic(adapter_id=adapter.id, version=adapter.version)


def _lost(job: Job) -> NoReturn:
    reason = "was cancelled" if job.status == "cancelled" else f"is {job.status}, and this device holds no lease on it"
    raise HTTPException(status.HTTP_409_CONFLICT, f"job {job.id} {reason}")


def _verify(
    pool: WorkerPool, settings: Settings, owner: int, ctx: dict, upload: Upload, init: Path | None, tmp: Path
) -> dict:
    """Replay and package in a worker (``server.uploads.run_verification``) → ``{"b_flat": (path, sha256),
    "archive": (path, sha256, size), "checks"}``."""
    b_path = None if upload.b_path is None else str(upload.b_path)
    args = (ctx, b_path, str(upload.log_path), init and str(init), str(tmp))
    checks = run_verification(pool, settings, owner, verify_and_package, *args)
    b_flat, archive = Path(checks.pop("b_flat")), Path(checks.pop("archive"))
    return {
        "b_flat": (b_flat, sha256_file(b_flat)),
        "archive": (archive, sha256_file(archive), archive.stat().st_size),
        "checks": checks,
    }


def _admit(job: Job, device: Device) -> None:
    """Before the body is read: 409 unless the device holds the job's lease (or the job succeeded: a repeat?)."""
    if job.program_id is None or (job.status != "succeeded" and not jobstate.holds_lease(job, device.id)):
        _lost(job)


@router.post(
    RESULT_UPLOAD,
    status_code=status.HTTP_201_CREATED,
    response_model=ResultPublic,
    responses={
        200: {"model": ResultPublic, "description": "the same result was uploaded before"},
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
            e409="the job was cancelled, its lease lost, or it holds a different result",
            e413="the body, or a part, is larger than the job allows",
            e422="a part is missing or malformed, or the log does not replay to the uploaded B",
            e429="too many uploads in progress (from this device or user, or in all), or this user's devices already "
            "have results being verified; retry after Retry-After seconds",
            e503="verification ran past its timeout or its worker died; retry after Retry-After seconds",
        ),
    },
    openapi_extra={"requestBody": RESULT_BODY},
)
def upload_result(
    job: DeviceJob,
    device: CurrentDevice,
    session: SessionDep,
    settings: SettingsDep,
    store: StoreDep,
    pool: VerifyPoolDep,
    slots: UploadSlotsDep,
    request: Request,
    response: Response,
) -> ResultPublic:
    """Checked in order: the token, the job and its lease, the sizes, the content (nothing read before the lease)."""
    _admit(job, device)
    ctx = _context(session, job, device)
    init = store.adapter_b(session.get_one(Adapter, job.init_adapter_id).b_sha256) if job.init_adapter_id else None
    session.commit()  # no transaction (and on SQLite no write lock) while receiving and replaying
    refuse_while_verifying(pool, device.user_id)
    slot = partial(slots.hold, device.id, device.user_id)  # taken when the body starts to arrive
    receiving = received_parts(
        request, store, upload_limit(ctx), RESULT_PARTS, ("b_flat",), BodyPace.of(settings), slot
    )
    with receiving as (parts, tmp):
        upload = receive(store, tmp, JobSpec.model_validate(ctx["spec"]), ctx["d"], parts)
        repeated = _repeat(session, job, upload)
        if repeated is not None:
            response.status_code = status.HTTP_200_OK
            return repeated
        session.commit()  # again no transaction while a worker replays
        if not jobstate.holds_lease(job, device.id):
            _lost(job)
        outcome = _verify(pool, settings, device.user_id, ctx, upload, init, tmp)
        for _ in range(3):  # a concurrent result of the same (user, model, task) may take our version number
            try:
                return _record(session, store, job, device, ctx, upload, outcome)
            except IntegrityError:
                session.rollback()
        raise HTTPException(status.HTTP_409_CONFLICT, "could not allocate an adapter version; retry")
