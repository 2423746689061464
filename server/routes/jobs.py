"""Jobs of the calling user: submit (``202``, compiled in the background), list, show, cancel. The admin token
lists, shows and cancels the cohorts' federated jobs (submitted at ``POST /v1/cohorts/{id}/jobs``)."""

from __future__ import annotations

from pathlib import Path

from fastapi import HTTPException, Query, status
from sqlalchemy.orm import Session

from server import privacy, queries, quotas, registry
from server.deps import (
    AccountantDep,
    CurrentUser,
    JobSpecsDep,
    ObjectId,
    QueueDep,
    SessionDep,
    SettingsDep,
    UserOrAdmin,
)
from server.model_lookup import registered_model, with_model_prompt
from server.responses import errors, field_error
from server.router import Router
from server.state import jobs
from server.tables import Device, Model, User
from server.views import caller_job, job_public
from shared.model_files import has_chat_template
from shared.schemas import MAX_DB_INT, JobCreate, JobPublic, JobsPublic
from shared.tasks import get_task

router = Router(prefix="/v1/jobs", tags=["jobs"])


def _check_model(session: Session, body: JobCreate) -> Model:
    return registered_model(session, body.model, body.targets)


def _check_device(session: Session, user: User, body: JobCreate) -> None:
    if body.device_id is None:
        return
    device = session.get(Device, body.device_id)
    if device is None or device.user_id != user.id:
        raise field_error("device_id", "must name a device of yours", status.HTTP_404_NOT_FOUND)
    if body.device_backend is not None and device.backend != body.device_backend:
        raise field_error("device_backend", f"must be the device's backend, {device.backend}")


def _check_init_adapter(session: Session, user: User, model: Model, body: JobCreate) -> None:
    """A starting adapter must be this user's, or a cohort's the user is a member of, and have the same LoRA layout
    (same B length, same A)."""
    if body.init_adapter_id is None:
        return
    adapter = registry.visible_adapter(session, user.id, body.init_adapter_id)
    if adapter is None:
        raise field_error("init_adapter_id", "must name an adapter you can see", status.HTTP_404_NOT_FOUND)
    if not registry.fits_as_start(adapter, model.id, body.model_dump()):
        raise field_error(
            "init_adapter_id", "the starting adapter differs in model, rank, alpha, targets or a_seed from this job"
        )


def _check_chat_template(model: Model, body: JobCreate) -> None:
    """A job asking for the chat template needs a model whose tokenizer has one (the compile would fail)."""
    if body.chat_template and not has_chat_template(Path(model.path)):
        raise field_error("chat_template", "the model's tokenizer has no chat template")


def _check_answer_len(body: JobCreate) -> None:
    """Only a verbalizer fixes the answers in advance; other tasks take their answers from the device's data."""
    if body.answer_len is None and get_task(body.task_name, body.template, body.verbalizer).kind != "classification":
        raise field_error("answer_len", f"required for task {body.task_name} (its answers come from the data)")


@router.post(
    "",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=JobPublic,
    responses=errors(
        400,
        401,
        403,
        404,
        413,
        422,
        429,
        409,
        503,
        e404="device_id or init_adapter_id names no device or adapter of yours",
        e409="a private job that would pass your privacy budget (the detail names what remains)",
        e429="too many unfinished or compiling jobs, or private submits in progress (Retry-After)",
        e503="your other private submits hold the ledger, or the privacy accountant did not answer (Retry-After)",
    ),
)
def submit(
    body: JobCreate,
    user: CurrentUser,
    session: SessionDep,
    queue: QueueDep,
    settings: SettingsDep,
    accountant: AccountantDep,
) -> JobPublic:
    """Submit a fine-tuning job; its program compiles in the background. A private job's noise is calibrated
    first (``server.privacy.resolve``: seconds the first time for its numbers), after its ledger is checked."""
    quotas.check_job_quota(session, user.id, settings)
    model = _check_model(session, body)
    body = with_model_prompt(model, body)
    _check_device(session, user, body)
    _check_init_adapter(session, user, model, body)
    _check_chat_template(model, body)
    _check_answer_len(body)
    spec, charge = body.model_dump(mode="json"), None
    with accountant.submitting(user if body.privacy is not None else None):
        if body.privacy is not None:
            resolved = privacy.resolve(session, accountant, user, settings, body.privacy, body.steps, body.batch_size)
            spec["privacy"] = resolved.model_dump(mode="json")
            charge = privacy.charge(user, settings, spec)
        job = jobs.submit(
            session,
            charge,
            user_id=user.id,
            model_id=model.id,
            task=body.task_key,
            spec=spec,
            private=body.privacy is not None,
            device_id=body.device_id,
            device_backend=body.device_backend,
            init_adapter_id=body.init_adapter_id,
            standing=body.standing,
        )
    if job is None:
        raise HTTPException(
            status.HTTP_503_SERVICE_UNAVAILABLE, "your other private submits hold the ledger", {"Retry-After": "1"}
        )
    queue.submit(job.id)
    return job_public(session, job, model.name, None)


@router.get("", response_model=JobsPublic, responses=errors(401, 403, 422))
def list_jobs(
    user: UserOrAdmin,
    session: SessionDep,
    specs: JobSpecsDep,
    skip: int = Query(0, ge=0, le=MAX_DB_INT),
    limit: int = Query(100, ge=1, le=1000),
) -> JobsPublic:
    """The user's jobs; for the admin, the cohorts' federated jobs."""
    rows, count = queries.jobs_of(session, None if user is None else user.id, skip, limit)
    return JobsPublic(data=[job_public(session, *row, specs=specs) for row in rows], count=count)


@router.get("/{job_id}", response_model=JobPublic, responses=errors(401, 403, 404, 422))
def show(job_id: ObjectId, user: UserOrAdmin, session: SessionDep) -> JobPublic:
    """One job: its status, progress and result."""
    return job_public(session, caller_job(session, user, job_id))


@router.post(
    "/{job_id}/cancel",
    response_model=JobPublic,
    responses=errors(401, 403, 404, 409, 413, 422, e409="the job already finished"),
)
def cancel(job_id: ObjectId, user: UserOrAdmin, session: SessionDep, queue: QueueDep) -> JobPublic:
    """Cancel a job that has not ended; its device stops at its next heartbeat."""
    job = caller_job(session, user, job_id)
    if not jobs.cancel(session, job):
        raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} already {job.status}")
    queue.cancel(job_id)  # a running export stops now instead of finishing for nothing
    return job_public(session, job)
