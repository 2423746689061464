"""A work item's result (``POST /v1/work/{work}/result``, ``routes/work.py``): one pipeline for every kind of item
(``upload``), read, verified by replay, published, then recorded as what the item's kind makes of it: a personal
job's adapter version (``JobResult``), or a round part's report (``PartResult``; the round's aggregation is
``server.federation``'s).

Multipart parts (``shared.schemas.RESULT_PARTS``): ``b_flat`` (safetensors, one float32 tensor ``b_flat`` [D]),
``log`` (JSON Lines, one record per step), ``metrics`` (a JSON object). A job submitted with ``upload: log``, and
every round part, takes no ``b_flat``: the server stores the replay of the log as its B. Checked in order: the
token (401/403), the item and the device's lease (404/409), before a byte of the body is read; then, holding one of
the upload slots (429 when none is free), the sizes (413) while the parts are spooled to a private temporary
directory, B's name, dtype, shape and finiteness, the log's structure and its line count against the steps (422),
then a worker replays the log from the starting B (a job's, or the round's B_r) and compares (422 if it does not
reproduce B: bit for bit, or within ``replay_tolerance`` for devices running eager torch). Only then are the
*replayed* B, the log (and a job's PEFT archive) published (temporary name, fsync, rename; the bucket), and
only after that does the unit of work that records them open: slow file and bucket I/O never holds the write
lock, and a recorded result always has its files (a result refused at its record leaves content-addressed files
that nothing names). A job's same upload again (the same uploaded bytes) answers 200 with the same adapter; a
different one after success is 409. A round part's is 409 once the round closed or the part's lease ran out.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, NoReturn, Protocol

from fastapi import HTTPException, Request, Response, status
from sqlalchemy.orm import Session

from server import federation, registry
from server.limits import UploadSlots, upload_body_limit
from server.pool import WorkerPool
from server.settings import Settings
from server.state import jobs, leases, rounds
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
Answer = ResultPublic | RoundReportPublic


class ItemResult(Protocol):
    """What an item's kind tells the pipeline (``upload``): made once the item is admitted (404/409 before the
    body), it names the parts and their limits, replays, publishes, and says what the verified result becomes."""

    spec: JobSpec
    d: int  # B's size, 0 where no B is uploaded
    limit: int  # the largest body a result of it can need
    parts: tuple[str, ...]
    optional: tuple[str, ...]

    def repeat(self, session: Session, upload: Upload) -> ResultPublic | None:
        """The stored answer if this upload repeats one already recorded (answered 200), else None."""

    def verify(self, pool: WorkerPool, settings: Settings, owner: int, upload: Upload, tmp: Path) -> dict[str, Any]:
        """Replay in a verify worker (``server.uploads.run_verification``) → what the worker made of it."""

    def publish(self, store: ArtifactStore, upload: Upload, outcome: dict[str, Any]) -> Any:
        """Store the verified files (content-addressed: the same bytes stored before are kept) → what names them."""

    def becomes(self, session: Session, upload: Upload, published: Any) -> Answer:
        """Record the verified, published result: the item's one unit of work (409 where it no longer may)."""


def upload(
    item: ItemResult,
    device: Device,
    session: Session,
    settings: Settings,
    store: ArtifactStore,
    pool: WorkerPool,
    slots: UploadSlots,
    request: Request,
    response: Response,
) -> Answer:
    """An admitted item's upload: received under the item's limits while holding an upload slot, verified by
    replay, published, then recorded. Nothing of the body is read before this (the item was admitted)."""
    refuse_while_verifying(pool, device.user_id)
    slot = partial(slots.hold, device.id, device.user_id)  # taken when the body starts to arrive
    pace = BodyPace.of(settings)
    with received_parts(request, store, item.limit, item.parts, item.optional, pace, slot) as (parts, tmp):
        received = receive(store, tmp, item.spec, item.d, parts)
        repeated = item.repeat(session, received)
        if repeated is not None:
            response.status_code = status.HTTP_200_OK
            return repeated
        outcome = item.verify(pool, settings, device.user_id, received, tmp)
        published = item.publish(store, received, outcome)  # before the unit that records it opens
    return item.becomes(session, received, published)


def _context(session: Session, job: Job, device: Device) -> dict[str, Any]:
    """What checking and packaging need to know about the job and the device (plain data, for the worker)."""
    program = session.get_one(Program, job.program_id)
    return {
        "spec": jobs.device_spec(job).model_dump(mode="json"),
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


class JobResult:
    """A personal job's result: B (or, with ``upload: log``, the log alone) replayed from the job's starting B and
    packaged; it becomes the job's next adapter version, the job succeeded. Made only while the device holds the
    job's lease (or the job succeeded: a repeat?), else 409."""

    parts, optional = RESULT_PARTS, ("b_flat",)

    def __init__(self, session: Session, store: ArtifactStore, job: Job, device: Device) -> None:
        if job.program_id is None or (job.status != "succeeded" and not jobs.holds_lease(job, device.id)):
            _lost(job)
        self.job, self.device = job, device
        self.ctx = _context(session, job, device)
        self.spec = JobSpec.model_validate(self.ctx["spec"])
        self.d, self.limit = self.ctx["d"], upload_limit(self.ctx)
        init = session.get_one(Adapter, job.init_adapter_id).b_sha256 if job.init_adapter_id else None
        self.init = None if init is None else store.adapter_b(init)

    def repeat(self, session: Session, upload: Upload) -> ResultPublic | None:
        """The stored result if this upload repeats it (the same uploaded bytes); 409 if the job holds another."""
        adapter = registry.job_adapter(session, self.job.id)
        if adapter is None:
            return None
        uploaded_b = adapter.upload_b_sha256 if upload.b_sha256 is not None else None  # log-only: the log decides
        if (uploaded_b, adapter.log_sha256) != (upload.b_sha256, upload.log_sha256):
            raise HTTPException(status.HTTP_409_CONFLICT, f"job {self.job.id} already has a different result")
        return ResultPublic(adapter_id=adapter.id, version=adapter.version)

    def verify(self, pool: WorkerPool, settings: Settings, owner: int, upload: Upload, tmp: Path) -> dict[str, Any]:
        """Replay and package → ``{"b_flat": (path, sha256), "archive": (path, sha256, size), "checks"}``."""
        b_path = None if upload.b_path is None else str(upload.b_path)
        args = (self.ctx, b_path, str(upload.log_path), self.init and str(self.init), str(tmp))
        checks = run_verification(pool, settings, owner, verify_and_package, *args)
        b_flat, archive = Path(checks.pop("b_flat")), Path(checks.pop("archive"))
        return {
            "b_flat": (b_flat, sha256_file(b_flat)),
            "archive": (archive, sha256_file(archive), archive.stat().st_size),
            "checks": checks,
        }

    def publish(self, store: ArtifactStore, upload: Upload, outcome: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """The replayed B (the B stored is the replay), the log and the archive → (``registry.StoredFiles``, the
        metrics the version keeps)."""
        archive, archive_sha, archive_size = outcome["archive"]
        replayed_b, replayed_b_sha = outcome["b_flat"]
        store.keep(replayed_b, "adapters", ".safetensors")
        store.keep(upload.log_path, "logs", ".jsonl")
        store.keep(archive, "archives", ".zip")
        uploaded_b_sha = upload.b_sha256 or replayed_b_sha  # a log-only upload's B is its replay
        files = registry.StoredFiles(replayed_b_sha, uploaded_b_sha, upload.log_sha256, archive_sha, archive_size)
        checks = dict(outcome["checks"])
        # the log's hash as this server computed it on receipt (a private job's metrics keep no hash the device wrote)
        stored = {**upload.metrics, "log_sha256": upload.log_sha256, "server": checks}
        if (losses := checks.pop("losses", None)) is not None:  # the verified log's, not the device's claim
            stored["losses"] = losses
        return files, stored

    def becomes(self, session: Session, upload: Upload, published: tuple[Any, dict[str, Any]]) -> ResultPublic:
        """running → succeeded and the new adapter version (``state.leases.accept_result``); the stored result if the
        job succeeded meanwhile with this same upload, else 409."""
        try:
            adapter = leases.accept_result(session, self.job, self.device, *published)
        except leases.VersionTaken as exc:
            raise HTTPException(status.HTTP_409_CONFLICT, f"{exc}; retry") from None
        if adapter is None:
            return self.repeat(session, upload) or _lost(self.job)
        return ResultPublic(adapter_id=adapter.id, version=adapter.version)


def _lost(job: Job) -> NoReturn:
    reason = "was cancelled" if job.status == "cancelled" else f"is {job.status}, and this device holds no lease on it"
    raise HTTPException(status.HTTP_409_CONFLICT, f"job {job.id} {reason}")


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
    elif rounds.buffered(job.federation):
        bound = job.federation["max_staleness"]
        reason = f"its lease ran out, the job ended, or its version is more than {bound} versions old (stale upload)"
    else:
        reason = "the round closed or its lease ran out (late upload)"
    return HTTPException(status.HTTP_409_CONFLICT, f"round client {client.id}: {reason}")


class PartResult:
    """A round part's result: its log (no B is uploaded), replayed from B_r; it becomes the part's report. The
    report that fills its round calls ``close_soon`` (the round sweeper's wake-up) and is answered at once: the
    close (aggregation, the adapter's packaging) is the sweeper's. Made only while the part is open, else 409."""

    parts, optional, d = LOG_PARTS, (), 0

    def __init__(self, session: Session, store: ArtifactStore, client: RoundClient, close_soon: Callable[[], None]):
        self.round, self.job = round_of(session, client)
        if not federation.part_is_open(session, client, self.round, self.job):
            raise _late(session, client, self.job)
        self.client, self.close_soon = client, close_soon
        self.ctx = federation.replay_context(session, self.job, client)
        self.init = store.adapter_b(self.round.b_sha256)
        self.spec = federation.client_spec(self.job, client)  # upload: log, as every round part
        self.limit = upload_body_limit(log_limit(self.spec), METRICS_LIMIT)

    def repeat(self, session: Session, upload: Upload) -> None:
        return None  # a part reported before is no longer open: 409 at its admission

    def verify(self, pool: WorkerPool, settings: Settings, owner: int, upload: Upload, tmp: Path) -> dict[str, Any]:
        args = (self.ctx, str(upload.log_path), str(self.init), str(tmp))
        return run_verification(pool, settings, owner, replay_log_only, *args)

    def publish(self, store: ArtifactStore, upload: Upload, outcome: dict[str, Any]) -> dict[str, Any]:
        """The replayed B and the log → the report (``state.rounds.client_reported``)."""
        b_sha = store.keep(Path(outcome["b_flat"]), "adapters", ".safetensors")[1]
        log_sha = store.keep(upload.log_path, "logs", ".jsonl")[1]
        return {
            "log_sha256": log_sha,
            "b_sha256": b_sha,
            "mean_loss": outcome["mean_loss"],
            "replay_s": outcome["replay_s"],
            "log_bytes": store.log(log_sha).stat().st_size,
        }

    def becomes(self, session: Session, upload: Upload, published: dict[str, Any]) -> RoundReportPublic:
        """leased → reported; 409 if its lease or its round ended meanwhile."""
        if not rounds.client_reported(session, self.client, published):
            raise _late(session, self.client, self.job)
        if federation.is_full(session, self.client):  # closed by the round sweeper: this device does not wait
            self.close_soon()
        return RoundReportPublic(client_id=self.client.id, round=self.round.index, b_sha256=published["b_sha256"])
