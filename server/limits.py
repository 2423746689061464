"""Limits on what one request may cost before it is authenticated and checked: body sizes and concurrent uploads.

``BodyLimits`` sits in front of the app (pure ASGI, so it runs before routing reads a byte): a JSON endpoint's
body may be at most ``JSON_LIMIT`` bytes (``ENROLL_LIMIT`` for ``POST /v1/devices``, whose enrollment code is
the credential, so that there the cap itself is the defence against an unauthenticated client), an upload at most
the server's ``max_upload_mb``. A declared ``Content-Length`` over the limit answers 413 at once; a body without
one (chunked) is counted as it is read and answers 413 as soon as it passes the limit. JSON bodies of kilobytes
cost microseconds to parse, so that they are read before the token is checked does not matter; the upload route
checks the token and the lease before it reads its (large) body.

``UploadSlots`` bounds the uploads being received and verified at once, per device and in total; a request over
either bound answers 429 with ``Retry-After``.
"""

from __future__ import annotations

import json
import re
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from fastapi import HTTPException, status
from starlette.types import ASGIApp, Message, Receive, Scope, Send

JSON_LIMIT = 64 * 1024  # a job spec with a 4 KB template and a large verbalizer fits with room to spare
ENROLL_LIMIT = 4 * 1024  # code, name, platform, backend, memory_mb
UPLOAD_PATH = re.compile(r"^/v1/jobs/[^/]+/result$")
RETRY_UPLOAD_S = 5


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` when a body passes its limit; an HTTPException, so FastAPI answers it as 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(status.HTTP_413_CONTENT_TOO_LARGE, f"request body over the limit of {limit} bytes")


def body_limit(method: str, path: str, upload_limit: int) -> int:
    """The largest body ``method path`` may carry."""
    if UPLOAD_PATH.match(path):
        return upload_limit
    if method == "POST" and path.rstrip("/") == "/v1/devices":
        return ENROLL_LIMIT
    return JSON_LIMIT


class BodyLimits:
    """413 for a body over its endpoint's limit, by ``Content-Length`` before reading and by counting while read."""

    def __init__(self, app: ASGIApp, upload_limit: int) -> None:
        self.app, self.upload_limit = app, upload_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = body_limit(scope["method"], scope["path"], self.upload_limit)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            return await reject(send, status.HTTP_413_CONTENT_TOO_LARGE, BodyTooLarge(limit).detail)
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:
                raise BodyTooLarge(limit)
            return message

        await self.app(scope, counted, send)


async def reject(send: Send, code: int, detail: str) -> None:
    """Answer ``{"detail": detail}`` with ``code`` without involving the app."""
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": code, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class UploadSlots:
    """At most ``total`` uploads at once, at most ``per_device`` of them from one device."""

    def __init__(self, total: int, per_device: int) -> None:
        self.total, self.per_device = total, per_device
        self._lock = threading.Lock()
        self._held: Counter[int] = Counter()

    @contextmanager
    def hold(self, device_id: int) -> Iterator[None]:
        """A slot for the duration of the block; 429 with ``Retry-After`` when none is free."""
        with self._lock:
            if self._held.total() >= self.total or self._held[device_id] >= self.per_device:
                raise HTTPException(
                    status.HTTP_429_TOO_MANY_REQUESTS,
                    "too many uploads in progress; retry later",
                    headers={"Retry-After": str(RETRY_UPLOAD_S)},
                )
            self._held[device_id] += 1
        try:
            yield
        finally:
            with self._lock:
                self._held[device_id] -= 1
                if not self._held[device_id]:
                    del self._held[device_id]
