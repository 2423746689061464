"""Limits on what one request may cost before it is authenticated and checked: body sizes and concurrent uploads.

``BodyLimits`` sits in front of the app (pure ASGI, so it runs before routing reads a byte): a JSON endpoint's
body may be at most ``JSON_LIMIT`` bytes (``ENROLL_LIMIT`` for ``POST /v1/devices``, whose enrollment code is
the credential, so that there the cap itself is the defence against an unauthenticated client), an upload at most
the server's ``max_upload_mb``. A declared ``Content-Length`` over the limit answers 413 at once; a body without
one (chunked) is counted as it is read and answers 413 as soon as it passes the limit. JSON bodies of kilobytes
cost microseconds to parse, so that they are read before the token is checked does not matter; the upload route
checks the token and the lease before it reads its (large) body.

The upload routes are named here, ``UPLOAD_ROUTES`` (a personal job's result, a round part's log): the routes take
their paths from it, so that no upload route can fall under the JSON cap. Each one's own cap follows from the
limits of its parts by ``upload_body_limit``, the one home of that rule, and is applied as its body is read
(``server.uploads.read_parts``).

``UploadSlots`` bounds the uploads being received and verified at once, per device, per user and in total; a
request over any bound answers 429 with ``Retry-After``. A slot is taken once the body starts to arrive and given
back when the body stops arriving at the required pace (``server.uploads.BodyPace``: 408), so that uploads that
send their head and stall hold nothing for long.

``RefusedUploads`` answers every refused upload (429, a lapsed lease's 409, any other error) only after a pause and
with ``Connection: close``: the server reads none of the body it refused, and a device that retries at once is held
to one try per pause and connection.

``Failures`` counts failed attempts per key (a client address, an account) over a sliding window, so that a caller
can refuse a key that failed too often before looking at what it sent (the dashboard's sign-in:
``server.dashboard.web``).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from fastapi import HTTPException, status
from starlette.types import ASGIApp, Message, Receive, Scope, Send

JSON_LIMIT = 64 * 1024  # a job spec with a 4 KB template and a large verbalizer fits with room to spare
ENROLL_LIMIT = 4 * 1024  # code, name, platform, backend, memory_mb, cpu
WORK_UPLOAD = "/v1/work/{work}/result"  # a work item's result: a job's B, log and metrics; a round part's log
UPLOAD_PATH = re.compile("^" + re.sub(r"\{[^/]+\}", "[^/]+", WORK_UPLOAD) + "$")
MULTIPART_OVERHEAD = 64 * 1024  # boundaries and part headers
RETRY_UPLOAD_S = 5


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` when a body passes its limit; an HTTPException, so FastAPI answers it as 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(status.HTTP_413_CONTENT_TOO_LARGE, f"request body over the limit of {limit} bytes")


def upload_body_limit(*part_limits: int) -> int:
    """The largest multipart body an upload route accepts: the sum of its parts' limits and the framing."""
    return sum(part_limits) + MULTIPART_OVERHEAD


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
    """At most ``total`` uploads at once, at most ``per_device`` of them from one device and ``per_user`` from the
    devices of one user, so that one tenant cannot take every slot. A slot is taken when an upload's body starts to
    arrive (``server.uploads.read_parts``), not before, and given back when its route is done with it, or as soon as
    the body stops arriving (too slow, or the client went away).

    The counters are this process's: with several API processes (``--workers``, or several machines) each bounds
    its own uploads, so the bounds in all are these times the processes. Counting in the database (a row per
    slot, with an expiry) or in the queue's broker would make them global; the per-process bounds still protect
    each process's threads and disk.
    """

    def __init__(self, total: int, per_device: int, per_user: int | None = None) -> None:
        self.total, self.per_device = total, per_device
        self.per_user = per_user if per_user is not None else total
        self._lock = threading.Lock()
        self._devices: Counter[int] = Counter()
        self._users: Counter[int] = Counter()

    def held(self) -> int:
        with self._lock:
            return self._devices.total()

    @contextmanager
    def hold(self, device_id: int, user_id: int) -> Iterator[None]:
        """A slot for the duration of the block; 429 with ``Retry-After`` when none is free."""
        with self._lock:
            if (
                self._devices.total() >= self.total
                or self._devices[device_id] >= self.per_device
                or self._users[user_id] >= self.per_user
            ):
                raise HTTPException(
                    status.HTTP_429_TOO_MANY_REQUESTS,
                    "too many uploads in progress; retry later",
                    headers={"Retry-After": str(RETRY_UPLOAD_S)},
                )
            self._devices[device_id] += 1
            self._users[user_id] += 1
        try:
            yield
        finally:
            with self._lock:
                for counter, key in ((self._devices, device_id), (self._users, user_id)):
                    counter[key] -= 1
                    if not counter[key]:
                        del counter[key]


class RefusedUploads:
    """An upload refused with any error (429: its user's verification places or upload slots are all taken; 409: its
    lease lapsed; 401, 404, 413, 422, ...) is answered after ``delay_s`` and with ``Connection: close``.

    Without it uvicorn keeps such a connection and reads, to discard it, the whole body the route refused unread
    (2.4 MB for a forged 20,000-step log), and a client that retries at once makes the next one at once: six of one
    tenant's devices doing so slowed another tenant's requests 5–11x on 2 cores (``benchmarks/fairness.py``). The
    pause is awaited in the event loop (no thread is held; the route has returned), while TCP's flow control stops
    the client's sending; an honest agent waits ``Retry-After`` anyway, which is longer.
    """

    def __init__(self, app: ASGIApp, delay_s: float) -> None:
        self.app, self.delay_s = app, delay_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not UPLOAD_PATH.match(scope["path"]):
            return await self.app(scope, receive, send)

        async def refusing(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= status.HTTP_400_BAD_REQUEST:
                await asyncio.sleep(self.delay_s)
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, refusing)


class Failures:
    """Failed attempts per key over the last ``window_s`` seconds: ``wait_s(key)`` is how long the key must wait
    before its next attempt (0: it may try now), once ``limit`` of its failures fall in the window.

    Memory is bounded: a key keeps at most ``limit`` times, a key whose failures all aged out is forgotten when next
    looked at, and past ``max_keys`` keys the one that failed least recently is forgotten (a client that makes up
    keys to push out another's count needs ``max_keys`` failures within one window to do it). The counts are this
    process's, like ``UploadSlots``'s: with several API processes each counts what it saw.
    """

    def __init__(
        self, limit: int, window_s: float, max_keys: int = 100_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limit, self.window_s, self.max_keys, self.clock = limit, window_s, max_keys, clock
        self._lock = threading.Lock()
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def wait_s(self, key: str) -> float:
        with self._lock:
            now = self.clock()
            times = self._recent(key, now)
            if times is None or len(times) < self.limit:
                return 0.0
            return times[0] + self.window_s - now

    def failed(self, key: str) -> None:
        with self._lock:
            now = self.clock()
            times = self._recent(key, now)
            if times is None:
                times = self._failures[key] = deque(maxlen=self.limit)
            times.append(now)
            self._failures.move_to_end(key)
            while len(self._failures) > self.max_keys:
                self._failures.popitem(last=False)

    def _recent(self, key: str, now: float) -> deque[float] | None:
        """The key's failures within the window (older ones dropped; a key with none left forgotten)."""
        times = self._failures.get(key)
        if times is None:
            return None
        while times and times[0] <= now - self.window_s:
            times.popleft()
        if not times:
            del self._failures[key]
            return None
        return times
