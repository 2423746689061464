"""``GET /v1/privacy``: the calling user's privacy ledger; ``PUT /v1/privacy``: its budget (``server.privacy``)."""

from __future__ import annotations

from server import privacy
from server.deps import CurrentUser, SessionDep, SettingsDep
from server.responses import errors
from server.router import Router
from shared.schemas import PrivacyBudget, PrivacyLedgerPublic

router = Router(prefix="/v1/privacy", tags=["privacy"])


@router.get("", response_model=PrivacyLedgerPublic, responses=errors(401, 403))
def show(user: CurrentUser, session: SessionDep, settings: SettingsDep) -> PrivacyLedgerPublic:
    """The caller's privacy ledger: the budget and what private jobs spent."""
    return privacy.public(privacy.ledger(session, user, settings))


@router.put(
    "",
    response_model=PrivacyLedgerPublic,
    responses=errors(400, 401, 403, 409, 413, 422, e409="the budget is below what your private jobs have spent"),
)
def set_budget(
    body: PrivacyBudget, user: CurrentUser, session: SessionDep, settings: SettingsDep
) -> PrivacyLedgerPublic:
    """Set the budget the user's private jobs spend from; it cannot go below what they spent already."""
    return privacy.set_budget(session, user, settings, body)
