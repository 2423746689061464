"""What the routes answer besides their models: errors in FastAPI's own validation shape (so that clients read one
format for every 4xx), and files by content (``serve_file``: ETag = sha256, Range and If-Range by Starlette)."""

from __future__ import annotations

from pathlib import Path

from fastapi import Header, HTTPException, Response, status
from fastapi.responses import FileResponse

FILE_RESPONSE = {200: {"content": {"application/octet-stream": {}}, "description": "the file (or the requested range)"}}
IfNoneMatch = Header(None, description="a quoted sha256 the client already has")


def field_error(field: str, message: str, code: int = status.HTTP_422_UNPROCESSABLE_CONTENT) -> HTTPException:
    """``{"detail": [{"loc": ["body", field], "msg": message, "type": "value_error"}]}`` with ``code``."""
    return HTTPException(code, [{"loc": ["body", field], "msg": message, "type": "value_error"}])


def try_later(code: int, detail: str, retry_after_s: int) -> HTTPException:
    """A 429 or 503 with ``Retry-After``: the same request may succeed later (the agent's retries honour it)."""
    return HTTPException(code, detail, headers={"Retry-After": str(max(1, retry_after_s))})


def not_found(what: str, object_id: int | str) -> HTTPException:
    """Missing and not-yours look the same: 404 with no hint that the object exists."""
    return HTTPException(status.HTTP_404_NOT_FOUND, f"{what} {object_id} not found")


def serve_file(
    path: Path, sha256: str, filename: str, if_none_match: str | None, media_type: str = "application/octet-stream"
) -> Response:
    """The file with ETag = its sha256; 304 when the client already has exactly these bytes."""
    etag = f'"{sha256}"'
    if if_none_match is not None and etag in [t.strip() for t in if_none_match.split(",")]:
        return Response(status_code=status.HTTP_304_NOT_MODIFIED, headers={"ETag": etag})
    return FileResponse(path, filename=filename, media_type=media_type, headers={"ETag": etag})
