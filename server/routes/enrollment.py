"""``POST /v1/enrollment-codes`` (user): a one-time, expiring code that enrolls one device for this user."""

from __future__ import annotations

from datetime import timedelta

from fastapi import status

from server.deps import CurrentUser, SessionDep
from server.responses import errors
from server.router import Router
from server.security import hash_secret, new_enrollment_code
from server.tables import EnrollmentCode, utcnow
from shared.schemas import EnrollmentCodeCreate, EnrollmentCodePublic

router = Router(prefix="/v1/enrollment-codes", tags=["devices"])


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=EnrollmentCodePublic,
    responses=errors(400, 401, 403, 413, 422),
)
def create_code(
    user: CurrentUser, session: SessionDep, body: EnrollmentCodeCreate | None = None
) -> EnrollmentCodePublic:
    body = body or EnrollmentCodeCreate()
    code = new_enrollment_code()
    expires_at = utcnow() + timedelta(seconds=body.ttl_s)
    row = EnrollmentCode(user_id=user.id, code_hash=hash_secret(code), expires_at=expires_at)
    session.add(row)
    session.commit()
    return EnrollmentCodePublic(code=code, expires_at=row.expires_at)
