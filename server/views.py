"""The public shape of a job (``JobPublic``), built in one place for the routes that answer with one: a user's jobs
(``routes/jobs.py``) and a cohort's federated jobs (``routes/cohorts.py``)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from server import federation
from server.tables import Adapter, Job, Model
from shared.schemas import FederationSpec, JobCreate, JobProgress, JobPublic


def job_public(
    session: Session,
    job: Job,
    model_name: str | None = None,
    adapter_id: int | None = None,
    held_out: dict | None = None,
) -> JobPublic:
    """``model_name``, ``adapter_id`` and the adapter's ``held_out`` may be given when the caller already joined
    them in."""
    if model_name is None:
        model_name = session.get_one(Model, job.model_id).name
        adapter = session.execute(select(Adapter.id, Adapter.held_out).where(Adapter.job_id == job.id)).first()
        adapter_id, held_out = adapter or (None, None)
    fed = job.federation is not None
    return JobPublic(
        id=job.id,
        status=job.status,
        model=model_name,
        task=job.task,
        spec=JobCreate.model_validate(job.spec),
        error=job.error,
        attempts=job.attempts,
        adapter_id=adapter_id,
        held_out=held_out,
        created_at=job.created_at,
        updated_at=job.updated_at,
        progress=JobProgress(step=job.progress_step, loss=job.progress_loss, steps_per_s=job.progress_steps_per_s),
        cohort_id=job.cohort_id,
        federation=FederationSpec.model_validate(job.federation) if fed else None,
        federation_progress=federation.progress(session, job) if fed else None,
    )
