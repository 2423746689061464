"""``GET /v1/privacy``: the calling user's privacy ledger; ``PUT /v1/privacy``: its budget (``server.privacy``)."""

from __future__ import annotations

from fastapi import status

from server import accounts, privacy
from server.deps import CurrentUser, SessionDep, SettingsDep
from server.responses import errors, field_error
from server.router import Router
from shared.schemas import Privacy, PrivacyBudget, PrivacyEntry, PrivacyLedgerPublic

router = Router(prefix="/v1/privacy", tags=["privacy"])


def _entry(job_id: int, status: str, spec: dict, spends: bool, round_: int | None = None) -> PrivacyEntry:
    """A ledger line: a private job, or (``round_`` set) a part of a private federated job."""
    p = Privacy.model_validate(spec["privacy"])
    return PrivacyEntry(
        job_id=job_id,
        status=status,
        steps=spec["steps"],
        batch_size=spec["batch_size"],
        privacy=p,
        spends=spends,
        round=round_,
    )


def _public(book: privacy.Ledger) -> PrivacyLedgerPublic:
    spent = book.spent()
    entries = [_entry(job.id, job.status, job.spec, privacy.spends(job)) for job in book.jobs]
    entries += [_entry(part.id, part.status, part.spec, True, part.index) for part in book.parts]
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
