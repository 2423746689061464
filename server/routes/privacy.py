"""``GET /v1/privacy``: the calling user's privacy ledger; ``PUT /v1/privacy``: its budget (``server.privacy``)."""

from __future__ import annotations

from fastapi import status

from server import accounts, privacy
from server.deps import CurrentUser, SessionDep, SettingsDep
from server.responses import errors, field_error
from server.router import Router
from shared.schemas import Privacy, PrivacyBudget, PrivacyEntry, PrivacyLedgerPublic

router = Router(prefix="/v1/privacy", tags=["privacy"])


def _public(book: privacy.Ledger) -> PrivacyLedgerPublic:
    spent = book.spent()
    entries = [
        PrivacyEntry(
            job_id=job.id,
            status=job.status,
            steps=job.spec["steps"],
            batch_size=job.spec["batch_size"],
            privacy=Privacy.model_validate(job.spec["privacy"]),
            spends=privacy.spends(job),
        )
        for job in book.jobs
    ] + [
        PrivacyEntry(
            job_id=part.id,
            status=part.status,
            steps=part.spec["steps"],
            batch_size=part.spec["batch_size"],
            privacy=Privacy.model_validate(part.spec["privacy"]),
            spends=True,
            round=part.index,
        )
        for part in book.parts
    ]
    budget = PrivacyBudget(epsilon=book.epsilon, delta=book.delta)
    return PrivacyLedgerPublic(budget=budget, spent=spent, remaining=max(book.epsilon - spent, 0.0), jobs=entries)


@router.get("", response_model=PrivacyLedgerPublic, responses=errors(401, 403))
def show(user: CurrentUser, session: SessionDep, settings: SettingsDep) -> PrivacyLedgerPublic:
    return _public(privacy.ledger(session, user, settings))


@router.put(
    "",
    response_model=PrivacyLedgerPublic,
    responses=errors(400, 401, 403, 409, 413, 422, e409="the budget is below what your private jobs have spent"),
)
def set_budget(
    body: PrivacyBudget, user: CurrentUser, session: SessionDep, settings: SettingsDep
) -> PrivacyLedgerPublic:
    """Set the budget the user's private jobs spend from; it cannot go below what they spent already."""
    if (spent := privacy.ledger(session, user, settings, body.delta).spent()) > body.epsilon:
        raise field_error(
            "epsilon", f"your private jobs spent {spent:.3g} at delta {body.delta:g}", status.HTTP_409_CONFLICT
        )
    accounts.set_privacy_budget(session, user, body.epsilon, body.delta)
    return _public(privacy.ledger(session, user, settings))
