"""Cohorts and consent: the admin creates a cohort (a model and a task) and submits its federated jobs; users list
cohorts and opt in or out with their own key. Only opted-in users' devices ever receive a cohort's round work.

``POST /v1/cohorts`` (admin), ``GET /v1/cohorts`` (admin or user), ``POST /v1/cohorts/{id}/join`` and
``/leave`` (user), ``POST /v1/cohorts/{id}/jobs`` (admin: a federated job, 202, compiled in the background),
``GET /v1/cohorts/{id}/privacy`` (admin or user) and ``PUT`` (admin): the cohort's privacy ledger and budget.
"""

from __future__ import annotations

from fastapi import HTTPException, status
from pydantic import ValidationError
from sqlalchemy.orm import Session

from server import accounts, privacy, queries
from server.deps import AccountantDep, AdminDep, CurrentUser, ObjectId, QueueDep, SessionDep, SettingsDep, UserOrAdmin
from server.model_lookup import with_model_prompt
from server.responses import errors, field_error, not_found
from server.router import Router
from server.state import jobs
from server.tables import Cohort, Model, User
from server.views import job_public
from shared.errors import UsageError
from shared.schemas import (
    CohortCreate,
    CohortPublic,
    CohortsPublic,
    FederatedJobCreate,
    FederationSpec,
    JobCreate,
    JobPublic,
    PrivacyBudget,
    PrivacyLedgerPublic,
)
from shared.tasks import get_task

router = Router(prefix="/v1/cohorts", tags=["cohorts"])


def public(session: Session, cohort: Cohort, user: User | None) -> CohortPublic:
    member = None
    if user is not None:
        row = accounts.membership(session, cohort.id, user.id)
        member = row is not None and row.left_at is None
    return CohortPublic(
        id=cohort.id,
        name=cohort.name,
        model=session.get_one(Model, cohort.model_id).name,
        task=cohort.task,
        members=queries.cohort_members(session, cohort.id),
        member=member,
        created_at=cohort.created_at,
    )


def _cohort(session: Session, cohort_id: int) -> Cohort:
    cohort = session.get(Cohort, cohort_id)
    if cohort is None:
        raise not_found("cohort")
    return cohort


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=CohortPublic,
    responses=errors(400, 401, 403, 409, 413, 422, e409="a cohort of that name exists"),
)
def create(body: CohortCreate, _: AdminDep, session: SessionDep) -> CohortPublic:
    """Create a cohort for federated rounds (admin)."""
    model = queries.model_named(session, body.model)
    if model is None:
        raise field_error("model", "must name a registered model")
    try:
        cohort = accounts.create_cohort(session, body.name, model.id, body.task)
    except accounts.Taken:
        raise HTTPException(status.HTTP_409_CONFLICT, "name: a cohort of this name exists") from None
    return public(session, cohort, None)


@router.get("", response_model=CohortsPublic, responses=errors(401, 403))
def list_cohorts(user: UserOrAdmin, session: SessionDep) -> CohortsPublic:
    """Every cohort, so that users can choose one to join; ``member`` says whether the caller is in it."""
    cohorts = queries.cohorts(session)
    return CohortsPublic(data=[public(session, c, user) for c in cohorts], count=len(cohorts))


@router.post("/{cohort_id}/join", response_model=CohortPublic, responses=errors(401, 403, 404, 413, 422))
def join(cohort_id: ObjectId, user: CurrentUser, session: SessionDep) -> CohortPublic:
    """Opt in: from now on this user's devices may receive the cohort's round work (joining twice is a no-op)."""
    cohort = _cohort(session, cohort_id)
    accounts.join_cohort(session, cohort.id, user.id)
    return public(session, cohort, user)


@router.post("/{cohort_id}/leave", response_model=CohortPublic, responses=errors(401, 403, 404, 413, 422))
def leave(cohort_id: ObjectId, user: CurrentUser, session: SessionDep) -> CohortPublic:
    """Opt out: no further round work for this user's devices, and the cohort's adapters are no longer visible to
    them (leaving twice, or without having joined, is a no-op)."""
    cohort = _cohort(session, cohort_id)
    accounts.leave_cohort(session, cohort.id, user.id)
    return public(session, cohort, user)


def _stored_spec(cohort: Cohort, model: Model, body: FederatedJobCreate) -> dict:
    """The job's spec in the shape every job stores (``JobCreate``): the cohort's model and task, the body's
    hyperparameters (``steps``: local steps per round), log-only uploads. Defaults the body took are taken again
    with the cohort's task, whose objective they depend on."""
    hyper = body.model_dump(include=set(JobCreate.model_fields) - {"model", "task"}, exclude=body.defaulted)
    try:
        spec = JobCreate(**hyper, model=model.name, task=cohort.task, upload="log")
    except ValidationError as exc:  # the checks that need the task: room for a prompt beside the answer
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else "answer_len"
        raise field_error(field, first["msg"].removeprefix("Value error, ")) from None
    if spec.answer_len is None and get_task(cohort.task, None, None).kind != "classification":
        raise field_error("answer_len", f"required for task {cohort.task} (its answers come from the data)")
    missing = [t for t in spec.targets if t not in {name.rsplit(".", 1)[-1] for name in model.modules}]
    if missing:
        present = sorted({name.rsplit(".", 1)[-1] for name in model.modules})
        raise field_error("targets", f"must be modules of the model: {', '.join(present)}")
    return with_model_prompt(model, spec).model_dump(mode="json")


@router.post(
    "/{cohort_id}/jobs",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=JobPublic,
    responses=errors(
        400,
        401,
        403,
        404,
        409,
        413,
        422,
        429,
        503,
        e409="a private job that would pass the cohort's privacy budget (the detail names what remains)",
        e429="the cohort's private submits in progress are at the bound (Retry-After)",
        e503="other private submits hold the cohort's ledger, or the privacy accountant did not answer (Retry-After)",
    ),
)
def submit(
    cohort_id: ObjectId,
    body: FederatedJobCreate,
    _: AdminDep,
    session: SessionDep,
    settings: SettingsDep,
    queue: QueueDep,
    accountant: AccountantDep,
):
    """A federated job: R rounds of K clients × N local steps; compiled like any job, then leased round by round.
    A private one spends from the cohort's privacy ledger."""
    cohort = _cohort(session, cohort_id)
    model = session.get_one(Model, cohort.model_id)
    try:
        spec = _stored_spec(cohort, model, body)
    except UsageError as exc:
        raise field_error(exc.argument.lstrip("-"), exc.reason) from None
    fed = body.model_dump(mode="json", include=set(FederationSpec.model_fields))
    charge = None
    with accountant.submitting(cohort if body.privacy is not None else None):
        if body.privacy is not None:  # each member's data: (epsilon, delta)-DP over every part it could train
            steps = body.steps * body.rounds
            resolved = privacy.resolve(session, accountant, cohort, settings, body.privacy, steps, body.batch_size)
            spec["privacy"] = resolved.model_dump(mode="json")
            charge = privacy.charge(cohort, settings, spec)
        job = jobs.submit(
            session,
            charge,
            user_id=None,
            cohort_id=cohort.id,
            model_id=model.id,
            task=cohort.task,
            spec=spec,
            private=body.privacy is not None,
            federation=fed,
        )
    if job is None:
        raise HTTPException(
            status.HTTP_503_SERVICE_UNAVAILABLE, "other private submits hold the cohort's ledger", {"Retry-After": "1"}
        )
    queue.submit(job.id)
    return job_public(session, job, model.name, None)


@router.get("/{cohort_id}/privacy", response_model=PrivacyLedgerPublic, responses=errors(401, 403, 404, 422))
def show_privacy(cohort_id: ObjectId, _: UserOrAdmin, session: SessionDep, settings: SettingsDep):
    """The cohort's privacy ledger: its budget and the private federated jobs that spend from it."""
    return privacy.public(privacy.ledger(session, _cohort(session, cohort_id), settings))


@router.put(
    "/{cohort_id}/privacy",
    response_model=PrivacyLedgerPublic,
    responses=errors(
        400, 401, 403, 404, 409, 413, 422, e409="the budget is below what the cohort's private jobs have spent"
    ),
)
def set_privacy_budget(
    cohort_id: ObjectId, body: PrivacyBudget, _: AdminDep, session: SessionDep, settings: SettingsDep
) -> PrivacyLedgerPublic:
    """Set what the cohort's private federated jobs may spend of each member's data; not below what they spent."""
    return privacy.set_budget(session, _cohort(session, cohort_id), settings, body)
