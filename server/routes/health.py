"""``GET /healthz``: liveness and whether the database answers (no authentication)."""

from __future__ import annotations

from fastapi import Response, status
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from server.db import discard
from server.deps import SessionDep
from server.router import Router
from shared.schemas import HealthPublic

router = Router(tags=["health"])


@router.get("/healthz", response_model=HealthPublic, responses={503: {"model": HealthPublic}})
def healthz(session: SessionDep, response: Response) -> HealthPublic:
    """Liveness and readiness: 200 while the database answers, else 503."""
    try:
        session.execute(text("SELECT 1"))
    except SQLAlchemyError:
        discard(session)
        response.status_code = status.HTTP_503_SERVICE_UNAVAILABLE
        return HealthPublic(status="degraded", database="unreachable")
    return HealthPublic(status="ok", database="ok")
