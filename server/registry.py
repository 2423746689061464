"""The adapter registry: versions counted per (user, model, task) — or per cohort for a cohort's adapters, which
belong to the cohort rather than a user — and each version's lineage (the job, or the round, that trained it, the
adapter it started from). Routes record and read adapters through it; it never commits, so a new version
lands in the same transaction as its job's ``succeeded``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from server.tables import Adapter, CohortMember, Job, Model, Program, Round
from server.verify import adapter_prompt
from shared.schemas import AdapterPrivacy, AdapterPublic


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
        held_out=_held_out(metrics),
        **_layout_and_files(spec, files, metrics),
    )
    session.add(adapter)
    session.flush()
    return adapter


def _layout_and_files(spec: dict[str, Any], files: StoredFiles, metrics: dict[str, Any]) -> dict[str, Any]:
    """What every adapter row holds, a user's or a cohort's: the LoRA layout, the stored files, the metrics."""
    return {
        "rank": spec["rank"],
        "alpha": spec["alpha"],
        "targets": spec["targets"],
        "a_seed": spec["a_seed"],
        "b_sha256": files.b_sha256,
        "upload_b_sha256": files.upload_b_sha256,
        "log_sha256": files.log_sha256,
        "archive_sha256": files.archive_sha256,
        "archive_size": files.archive_size,
        "metrics": metrics,
    }


def _held_out(metrics: dict[str, Any]) -> dict[str, Any] | None:
    """The before/after summary the registry shows (``HeldOut``), from the verified upload's evaluations."""
    from shared.schemas import HeldOut

    summary = HeldOut.from_metrics(metrics)
    return None if summary is None else summary.model_dump(mode="json")


def add_cohort_version(
    session: Session, job: Job, round_: Round, files: StoredFiles, metrics: dict[str, Any]
) -> Adapter:
    """The cohort's next version (B_{r+1} of ``round_``), owned by the cohort, not a user; its parent is the
    version the round started from, if any. Flushed, not committed (the round closes in the same transaction)."""
    latest = session.scalar(select(func.max(Adapter.version)).where(Adapter.cohort_id == job.cohort_id))
    parent = session.scalar(select(Round.adapter_id).where(Round.job_id == job.id, Round.index == round_.index - 1))
    adapter = Adapter(
        user_id=None,
        cohort_id=job.cohort_id,
        round_id=round_.id,
        model_id=job.model_id,
        task=job.task,
        version=(latest or 0) + 1,
        job_id=None,
        parent_id=parent,
        **_layout_and_files(job.spec, files, metrics),
    )
    session.add(adapter)
    session.flush()
    return adapter


def adapter_privacy(spec: dict[str, Any] | None, rounds: int = 1) -> AdapterPrivacy | None:
    """The guarantee of a private job's adapter, from the job's spec as submitted (σ set by the server); a federated
    job's over its ``rounds`` × local steps (a member trains at most one part per round: the accountant's steps)."""
    private = (spec or {}).get("privacy")
    if private is None:
        return None
    return AdapterPrivacy(
        epsilon=private["epsilon"],
        delta=private["delta"],
        noise_multiplier=private["noise_multiplier"],
        clip=private["clip"],
        steps=spec["steps"] * rounds,
        sampling_rate=spec["batch_size"] / private["min_examples"],
    )


def _manifest(session: Session, job: Job) -> dict[str, Any]:
    return session.get_one(Program, job.program_id).manifest


def adapter_public(session: Session, adapter: Adapter, model_name: str) -> AdapterPublic:
    """An adapter as the REST answers show it (to its user, the cohort's members, and the user's devices)."""
    round_ = None if adapter.round_id is None else session.get_one(Round, adapter.round_id)
    job_id = adapter.job_id if round_ is None else round_.job_id
    job = None if job_id is None else session.get_one(Job, job_id)
    return AdapterPublic(
        id=adapter.id,
        model=model_name,
        task=adapter.task,
        version=adapter.version,
        job_id=adapter.job_id if round_ is None else round_.job_id,
        cohort_id=adapter.cohort_id,
        round=None if round_ is None else round_.index,
        parent_adapter_id=adapter.parent_id,
        rank=adapter.rank,
        alpha=adapter.alpha,
        targets=adapter.targets,
        a_seed=adapter.a_seed,
        b_sha256=adapter.b_sha256,
        base_sha256=session.get_one(Model, adapter.model_id).sha256,
        metrics=adapter.metrics,
        held_out=adapter.held_out,
        promoted=adapter.promoted,
        privacy=None if job is None else adapter_privacy(job.spec, (job.federation or {}).get("rounds", 1)),
        prompt=None if job is None or job.program_id is None else adapter_prompt(job, _manifest(session, job)),
        created_at=adapter.created_at,
    )


def visible_to(user_id: int):
    """SQL condition, the one rule of who sees an adapter: its user, and while they are in its cohort (joined and
    not left), a cohort's members. Used by the user's registry (list, show, download), their devices' inference
    (``/v1/device/adapters``) and a job's starting adapter."""
    cohorts = select(CohortMember.cohort_id).where(CohortMember.user_id == user_id, CohortMember.left_at.is_(None))
    return or_(Adapter.user_id == user_id, Adapter.cohort_id.in_(cohorts))


def visible_adapter(session: Session, user_id: int, adapter_id: int) -> Adapter | None:
    """The adapter if the user may see it (``visible_to``), else None."""
    return session.scalar(select(Adapter).where(Adapter.id == adapter_id, visible_to(user_id)))
