"""What the routes answer besides their models: errors in FastAPI's own validation shape (so that clients read one
format for every 4xx), their documentation (``errors``), and files by content (``serve_file``: ETag = sha256,
Range and If-Range by Starlette).

Two exception handlers complete FastAPI's: ``validation_error`` answers 422 naming the field and the reason but
never the input (a client's megabytes must not come back, nor a secret it mistyped), and ``http_error`` gives a
405 an ``Allow`` header with every method documented for the path (Starlette names only one route's methods). The
dashboard, a sub-application of its own, answers its pages' errors with pages (``server.dashboard``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Header, HTTPException, Request, Response, status
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import MalformedRangeHeader, RangeNotSatisfiable

from shared.schemas import ErrorPublic
from shared.text_fields import escape_controls

_ERRORS = {
    400: "the body cannot be parsed (not UTF-8 JSON)",
    401: "missing or invalid bearer token",
    403: "a valid token of another kind (admin, user API key, device token)",
    404: "not found, or not the caller's",
    408: "the upload's body did not arrive at the required pace (or the client went away); retry",
    409: "conflicts with the current state",
    413: "the request body is larger than this endpoint accepts",
    416: "the Range header asks for bytes past the end of the file (Content-Range gives its size)",
    422: "a field is invalid: the detail names it and why",
    429: "too many requests in progress; retry after Retry-After seconds",
    503: "the work was stopped (timed out, or its worker died); retry after Retry-After seconds",
}
_METHODS = frozenset({"GET", "PUT", "POST", "DELETE", "OPTIONS", "HEAD", "PATCH", "TRACE"})
FILE_RESPONSE = {
    200: {"content": {"application/octet-stream": {}}, "description": "the file"},
    206: {"content": {"application/octet-stream": {}}, "description": "the range (or ranges) the Range header asked"},
    304: {"description": "If-None-Match named this file's sha256 (or *): the client has it"},
}
IfNoneMatch = Header(None, description="a quoted sha256 the client already has (or *)")
RANGE_ERRORS = {"e400": "a malformed Range header"}  # with errors(400, 416, ...): a file route's Range errors


def errors(*codes: int, **descriptions: str) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for error ``codes``, with ``ErrorPublic``; ``e409="..."`` overrides a description."""
    return {code: {"model": ErrorPublic, "description": descriptions.get(f"e{code}", _ERRORS[code])} for code in codes}


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 with each error's place, message and type, without FastAPI's ``input`` and ``ctx`` (echoes of input),
    and with any of the input's strings a shared check quoted in its message (``unknown task '...'``) cut out."""
    detail = [
        {"loc": [_short(p) for p in e["loc"]], "msg": _unquoted(e["msg"], e.get("input"), e["loc"]), "type": e["type"]}
        for e in exc.errors()
    ]
    return JSONResponse({"detail": detail}, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)


_MAX_SCRUBBED = 256  # strings of one input looked for in a message: a request body has few fields


def _strings(value: Any, found: list[str], depth: int = 0, names: bool = False) -> list[str]:
    """The strings in ``value`` (values and keys of objects, items of lists; not the keys of ``value`` itself when
    they are the ``names`` of fields, which messages name), at most ``_MAX_SCRUBBED`` of them and 8 levels deep (a
    request's fields are; a deeper input is refused for its shape, which quotes nothing)."""
    if len(found) >= _MAX_SCRUBBED or depth > 8:
        return found
    if isinstance(value, str):
        found.append(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            if not names:
                _strings(key, found, depth + 1)
            _strings(item, found, depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _strings(item, found, depth + 1)
    return found


def _unquoted(msg: str, value: Any, loc: tuple | list) -> str:
    """``msg`` without the input's strings: quoted (``'...'``, as ``!r`` writes them) wherever they appear, bare
    when they are long enough (8+ characters) not to be a word of the message itself. The input of a check of the
    whole body (``loc`` ``("body",)``) is the body, whose keys are the names of its fields (an unknown one is
    refused on its own, its name cut to 64 characters by ``_short``)."""
    for text in sorted(_strings(value, [], names=tuple(loc) == ("body",)), key=len, reverse=True):
        if text:
            msg = msg.replace(repr(text), "'…'")
            if len(text) >= 8:
                msg = msg.replace(text, "…")
    return msg


def _short(part: str | int) -> str | int:
    """A place in the body; an unknown key is the client's input, so only its start is named, its control characters
    as escapes (``shared.text_fields.escape_controls``)."""
    return escape_controls(part[:64]) if isinstance(part, str) else part


async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
    """FastAPI's answer, but a 405 lists the methods of every route matching the path."""
    if exc.status_code == status.HTTP_405_METHOD_NOT_ALLOWED:
        allow = ", ".join(allowed_methods(request.app, request.scope["path"]))
        exc = StarletteHTTPException(exc.status_code, exc.detail, headers={"Allow": allow})
    return await http_exception_handler(request, exc)


def allowed_methods(app: FastAPI, path: str) -> list[str]:
    """The methods OpenAPI documents for ``path`` (HEAD wherever GET is, as Starlette answers it)."""
    methods = {
        method.upper()
        for template, operations in app.openapi()["paths"].items()
        if re.fullmatch(re.sub(r"\{[^/]+\}", "[^/]+", template), path)
        for method in operations
        if method.upper() in _METHODS
    }
    return sorted(methods | ({"HEAD"} if "GET" in methods else set()))


def field_error(
    field: str, message: str, code: int = status.HTTP_422_UNPROCESSABLE_CONTENT, where: str = "body"
) -> HTTPException:
    """``{"detail": [{"loc": [where, field], "msg": message, "type": "value_error"}]}`` with ``code``."""
    return HTTPException(code, [{"loc": [where, field], "msg": message, "type": "value_error"}])


def try_later(code: int, detail: str, retry_after_s: int) -> HTTPException:
    """A 429 or 503 with ``Retry-After``: the same request may succeed later (the agent's retries honour it)."""
    return HTTPException(code, detail, headers={"Retry-After": str(max(1, retry_after_s))})


def not_found(what: str) -> HTTPException:
    """Missing and not-yours look the same: 404 with no hint that the object exists (nor the id asked for: errors
    name the field and the rule, never the value)."""
    return HTTPException(status.HTTP_404_NOT_FOUND, f"{what} not found")


def serve_file(
    path: Path, sha256: str, filename: str, if_none_match: str | None, media_type: str = "application/octet-stream"
) -> Response:
    """The file with ETag = its sha256; 304 when the client already has exactly these bytes: If-None-Match names
    its ETag (compared weakly, as RFC 9110 has it for If-None-Match: ``W/`` is ignored) or is ``*``."""
    etag = f'"{sha256}"'
    named = [t.strip().removeprefix("W/") for t in (if_none_match or "").split(",")]
    if if_none_match is not None and (etag in named or named == ["*"]):
        return Response(status_code=status.HTTP_304_NOT_MODIFIED, headers={"ETag": etag})
    return _File(path, filename=filename, media_type=media_type, headers={"ETag": etag})


class _File(FileResponse):
    """Starlette's ``FileResponse`` whose Range errors are this API's errors (JSON ``ErrorPublic``, as documented),
    not plain text: 400 for a malformed Range header, 416 with ``Content-Range`` for one past the end of the file."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        wanted = Request(scope).headers.get("range")
        if wanted is not None and scope["method"] in ("GET", "HEAD"):
            try:
                self._parse_range_header(wanted, Path(self.path).stat().st_size)
            except MalformedRangeHeader as exc:
                detail = f"a malformed Range header: {exc.content or 'expected bytes=start-end'}"
                return await _error(status.HTTP_400_BAD_REQUEST, detail)(scope, receive, send)
            except RangeNotSatisfiable as exc:
                answer = _error(status.HTTP_416_RANGE_NOT_SATISFIABLE, f"the file has {exc.max_size} bytes")
                answer.headers["Content-Range"] = f"bytes */{exc.max_size}"
                return await answer(scope, receive, send)
        await super().__call__(scope, receive, send)


def _error(code: int, detail: str) -> JSONResponse:
    return JSONResponse(ErrorPublic(detail=detail).model_dump(), status_code=code)
