"""A work item's result (``POST /v1/work/{work}/result``, ``routes/work.py``), checked and recorded: a personal job's
trained B, training log and metrics (``upload_result``), or a round part's log and metrics (``part_upload``: replayed
from B_r, the round's aggregation in ``server.federation``).

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
after success is 409. A round part's log goes the same way (``server.uploads``) without B, and is 409 once the round
closed or the part's lease ran out.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

from fastapi import HTTPException, Request, Response, status
from sqlalchemy.orm import Session

from server import federation, jobstate, registry
from server.limits import UploadSlots, upload_body_limit
from server.pool import WorkerPool
from server.settings import Settings
from server.store import ArtifactStore
from server.tables import Adapter, Device, Job, Model, Program, Round, RoundClient
from server.uploads import BodyPace, Upload, receive, received_parts, refuse_while_verifying, run_verification
from server.verify import (
    METRICS_LIMIT,
    b_limit,
    b_size,
    base_of,
    card_of,
    exact_replay,
    log_limit,
    replay_log_only,
    verify_and_package,
)
from shared.files import sha256_file
from shared.schemas import RESULT_PARTS, JobSpec, ResultPublic, RoundReportPublic

LOG_PARTS = ("log", "metrics")  # a round part's upload: its log alone


def _context(session: Session, job: Job, device: Device) -> dict[str, Any]:
    """What checking and packaging need to know about the job and the device (plain data, for the worker)."""
    program = session.get_one(Program, job.program_id)
    return {
        "spec": jobstate.device_spec(job).model_dump(mode="json"),
        "manifest": program.manifest,
        "d": b_size(program.manifest),
        **base_of(session.get_one(Model, job.model_id)),
        "card": card_of(job, program.manifest, device.backend),
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
    session: Session, store: ArtifactStore, job: Job, device: Device, upload: Upload, outcome: dict
) -> ResultPublic:
    """running → succeeded and the new adapter version (``jobstate.accept_result``), the files published before
    the commit; the stored result if the job succeeded meanwhile with this same upload, else 409."""
    archive, archive_sha, archive_size = outcome["archive"]
    replayed_b, replayed_b_sha = outcome["b_flat"]
    uploaded_b_sha = upload.b_sha256 or replayed_b_sha  # a log-only upload's B is its replay
    files = registry.StoredFiles(replayed_b_sha, uploaded_b_sha, upload.log_sha256, archive_sha, archive_size)
    checks = dict(outcome["checks"])
    # the log's hash as this server computed it on receipt (a private job's metrics keep no hash the device wrote)
    stored = {**upload.metrics, "log_sha256": upload.log_sha256, "server": checks}
    if (losses := checks.pop("losses", None)) is not None:  # the verified log's, not the device's claim
        stored["losses"] = losses
    try:
        adapter = jobstate.accept_result(
            session, job, device, files, stored, partial(_publish, store, upload, replayed_b, archive)
        )
    except jobstate.VersionTaken as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, f"{exc}; retry") from None
    if adapter is None:
        return _repeat(session, job, upload) or _lost(job)
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


def upload_result(
    job: Job,
    device: Device,
    session: Session,
    settings: Settings,
    store: ArtifactStore,
    pool: WorkerPool,
    slots: UploadSlots,
    request: Request,
    response: Response,
) -> ResultPublic:
    """Checked in order: the token, the job and its lease, the sizes, the content (nothing read before the lease)."""
    _admit(job, device)
    ctx = _context(session, job, device)
    init = store.adapter_b(session.get_one(Adapter, job.init_adapter_id).b_sha256) if job.init_adapter_id else None
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
        outcome = _verify(pool, settings, device.user_id, ctx, upload, init, tmp)
        return _record(session, store, job, device, upload, outcome)


def round_of(session: Session, client: RoundClient) -> tuple[Round, Job]:
    round_ = session.get_one(Round, client.round_id)
    return round_, session.get_one(Job, round_.job_id)


def _late(session: Session, client: RoundClient, job: Job) -> HTTPException:
    """409 for a part that takes no report, saying why as its row says now: its report was received before (a
    device re-sending one whose answer it lost), or it is too late."""
    session.refresh(client)
    if client.status == "reported":
        counted = "" if client.counted_in_round_id is None else ", and counted"
        reason = f"its report was received before{counted} (this upload changes nothing)"
    elif jobstate.buffered(job.federation):
        bound = job.federation["max_staleness"]
        reason = f"its lease ran out, the job ended, or its version is more than {bound} versions old (stale upload)"
    else:
        reason = "the round closed or its lease ran out (late upload)"
    return HTTPException(status.HTTP_409_CONFLICT, f"round client {client.id}: {reason}")


def part_upload(
    client: RoundClient,
    session: Session,
    settings: Settings,
    store: ArtifactStore,
    pool: WorkerPool,
    slots: UploadSlots,
    request: Request,
    close_soon: Callable[[], None],
) -> RoundReportPublic:
    """A round part's result (``POST /v1/work/part-{id}/result``): multipart ``log`` and ``metrics``; the log is
    checked and replayed from B_r (no B is uploaded). The report that fills its round calls ``close_soon`` (the
    round sweeper's wake-up) and is answered at once: the close (aggregation, the adapter's packaging) is the
    sweeper's."""
    round_, job = round_of(session, client)
    if not federation.part_is_open(session, client, round_, job):
        raise _late(session, client, job)
    ctx = federation.replay_context(session, job, client)
    init = store.adapter_b(round_.b_sha256)
    spec = federation.client_spec(job, client)  # upload: log, as every round part
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
            raise _late(session, client, job)
    if federation.is_full(session, client):  # closed by the round sweeper: this device does not wait for it
        close_soon()
    return RoundReportPublic(client_id=client.id, round=round_.index, b_sha256=b_sha)
