"""``POST /v1/enrollment-codes`` (user): a one-time, expiring code that enrolls one device for this user; at most
``enrollment_codes_per_hour`` per user (``server.quotas``)."""

from __future__ import annotations

from datetime import timedelta

from fastapi import status

from server import accounts, quotas
from server.deps import CurrentUser, SessionDep, SettingsDep
from server.responses import errors
from server.router import Router
from server.security import hash_secret, new_enrollment_code
from server.tables import utcnow
from shared.schemas import EnrollmentCodeCreate, EnrollmentCodePublic

router = Router(prefix="/v1/enrollment-codes", tags=["devices"])


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=EnrollmentCodePublic,
    responses=errors(400, 401, 403, 413, 422, 429, e429="too many codes made in the last hour (Retry-After)"),
)
def create_code(
    user: CurrentUser, session: SessionDep, settings: SettingsDep, body: EnrollmentCodeCreate | None = None
) -> EnrollmentCodePublic:
    """A one-time code that enrolls one device for the caller."""
    quotas.check_code_quota(session, user.id, settings)
    body = body or EnrollmentCodeCreate()
    code = new_enrollment_code()
    expires_at = utcnow() + timedelta(seconds=body.ttl_s)
    row = accounts.create_enrollment_code(session, user.id, hash_secret(code), expires_at)
    return EnrollmentCodePublic(code=code, expires_at=row.expires_at)
