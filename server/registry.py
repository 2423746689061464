"""The adapter registry: versions counted per (user, model, task), and each version's lineage (the job that trained
it, the adapter it started from). Routes record and read adapters through it; it never commits, so a new version
lands in the same transaction as its job's ``succeeded``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from server.tables import Adapter, Job


@dataclass(frozen=True)
class StoredFiles:
    """The content addresses of a result's files in the store (``server.store.ArtifactStore``), and the hash of
    the B as uploaded (the store holds the replayed B)."""

    b_sha256: str
    upload_b_sha256: str
    log_sha256: str
    archive_sha256: str
    archive_size: int


def job_adapter(session: Session, job_id: int) -> Adapter | None:
    """The adapter a job produced, if it succeeded."""
    return session.scalar(select(Adapter).where(Adapter.job_id == job_id))


def fits_as_start(adapter: Adapter, model_id: int, spec: dict[str, Any]) -> bool:
    """Whether a job (``spec``: ``JobCreate`` fields) can start from ``adapter``: same model and LoRA layout, so the
    same B length and the same A."""
    mine = (model_id, spec["rank"], spec["alpha"], sorted(spec["targets"]), spec["a_seed"])
    theirs = (adapter.model_id, adapter.rank, adapter.alpha, sorted(adapter.targets), adapter.a_seed)
    return mine == theirs


def _next_version(session: Session, job: Job) -> int:
    latest = session.scalar(
        select(func.max(Adapter.version)).where(
            Adapter.user_id == job.user_id, Adapter.model_id == job.model_id, Adapter.task == job.task
        )
    )
    return (latest or 0) + 1


def add_version(
    session: Session, job: Job, spec: dict[str, Any], files: StoredFiles, metrics: dict[str, Any]
) -> Adapter:
    """The next version of the job's (user, model, task), started from the job's starting adapter; flushed, not
    committed. A concurrent result of the same (user, model, task) may take the number first: the flush (or the
    commit) then raises ``IntegrityError`` and the caller tries again in a new transaction."""
    adapter = Adapter(
        user_id=job.user_id,
        model_id=job.model_id,
        task=job.task,
        version=_next_version(session, job),
        job_id=job.id,
        parent_id=job.init_adapter_id,
        rank=spec["rank"],
        alpha=spec["alpha"],
        targets=spec["targets"],
        a_seed=spec["a_seed"],
        b_sha256=files.b_sha256,
        upload_b_sha256=files.upload_b_sha256,
        log_sha256=files.log_sha256,
        archive_sha256=files.archive_sha256,
        archive_size=files.archive_size,
        metrics=metrics,
    )
    session.add(adapter)
    session.flush()
    return adapter
