"""What a caller may see, decided in one place for the REST routes and the dashboard (``server.dashboard.pages``):
a job, an adapter or a device of the caller's (404 for anyone else's: missing and not-yours look alike), and the
public shape of a job (``JobPublic``): a user's jobs (``routes/jobs.py``) and a cohort's federated jobs
(``routes/cohorts.py``)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from server import federation, registry
from server.lru import LRUCache
from server.responses import not_found, serve_file
from server.state import sessions
from server.store import ArtifactStore
from server.tables import Adapter, Device, Job, Model, User
from shared.schemas import FederationSpec, JobCreate, JobProgress, JobPublic


def job_spec(job: Job, specs: LRUCache[int, JobCreate] | None = None) -> JobCreate:
    """The job's spec as submitted. A job's spec is written once and never changes, so a list shown again parses
    each only once per API process (``specs``, the app's cache: the validation is most of a row's cost)."""
    spec = specs.get(job.id) if specs is not None else None
    if spec is None:
        spec = JobCreate.model_validate(job.spec)
        if specs is not None:
            specs.put(job.id, spec)
    return spec


def job_public(
    session: Session,
    job: Job,
    model_name: str | None = None,
    adapter_id: int | None = None,
    held_out: dict | None = None,
    specs: LRUCache[int, JobCreate] | None = None,
) -> JobPublic:
    """``model_name``, ``adapter_id`` and the adapter's ``held_out`` may be given when the caller already joined
    them in. A standing job's adapter is its promoted version. ``specs``: the app's parsed specs (``job_spec``), for
    lists."""
    if model_name is None:
        model_name = session.get_one(Model, job.model_id).name
        own = Adapter.id == job.promoted_adapter_id if job.standing else Adapter.job_id == job.id
        adapter = session.execute(select(Adapter.id, Adapter.held_out).where(own)).first()
        adapter_id, held_out = adapter or (None, None)
    fed = job.federation is not None
    return JobPublic(
        id=job.id,
        status=job.status,
        model=model_name,
        task=job.task,
        spec=job_spec(job, specs),
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
        standing_job_id=job.standing_job_id,
        sessions_run=sessions.sessions_run(session, job.id) if job.standing else None,
    )


def caller_job(session: Session, user: User | None, job_id: int) -> Job:
    """The job if it belongs to the user (``user``), or is a cohort's federated job (the admin: ``user`` None);
    404 otherwise."""
    job = session.get(Job, job_id)
    if job is None or (job.user_id != user.id if user is not None else job.cohort_id is None):
        raise not_found("job")
    return job


def user_adapter(session: Session, user_id: int, adapter_id: int) -> Adapter:
    """The adapter if it is the user's, or a cohort's the user is in now (``registry.visible_adapter``); 404
    otherwise."""
    adapter = registry.visible_adapter(session, user_id, adapter_id)
    if adapter is None:
        raise not_found("adapter")
    return adapter


def caller_device(session: Session, user: User | None, device_id: int) -> Device:
    """The device if it is the user's (the admin, ``user`` None: any); 404 otherwise."""
    device = session.get(Device, device_id)
    if device is None or (user is not None and device.user_id != user.id):
        raise not_found("device")
    return device


def archive_response(session: Session, store: ArtifactStore, adapter: Adapter, if_none_match: str | None = None):
    """The adapter's PEFT archive as a download named ``<model>-<task>-v<version>.zip``."""
    model_name = session.get_one(Model, adapter.model_id).name
    filename = f"{model_name}-{adapter.task}-v{adapter.version}.zip"
    sha256 = adapter.archive_sha256
    return serve_file(store.archive(sha256), sha256, filename, if_none_match, "application/zip")
