"""Error answers in FastAPI's own validation shape, so that clients read one format for every 4xx."""

from __future__ import annotations

from fastapi import HTTPException, status


def field_error(field: str, message: str, code: int = status.HTTP_422_UNPROCESSABLE_CONTENT) -> HTTPException:
    """``{"detail": [{"loc": ["body", field], "msg": message, "type": "value_error"}]}`` with ``code``."""
    return HTTPException(code, [{"loc": ["body", field], "msg": message, "type": "value_error"}])


def not_found(what: str, object_id: int | str) -> HTTPException:
    """Missing and not-yours look the same: 404 with no hint that the object exists."""
    return HTTPException(status.HTTP_404_NOT_FOUND, f"{what} {object_id} not found")
