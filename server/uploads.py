"""Receiving a device's multipart upload (a job's result, a round client's log): reading the parts at a required
pace while holding an upload slot, spooling each under its limit, and running the torch-side check in a verify
worker with its failures mapped onto answers.

One home for what a job's and a round part's result (``server.results``) both do, so that a log-only upload is
received exactly like a full one.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
from fastapi import HTTPException, Request, status
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Message

from server import metrics
from server.pool import OwnerBusy, WorkerDied, WorkerPool, WorkTimedOut
from server.responses import field_error, try_later
from server.settings import Settings
from server.store import ArtifactStore
from server.verify import (
    METRICS_LIMIT,
    ResultRejected,
    b_limit,
    check_b,
    check_step_count,
    log_limit,
    parse_metrics,
)
from shared.files import sha256_file
from shared.schemas import JobSpec

log = logging.getLogger(__name__)
Slot = Callable[[], AbstractContextManager[object]]


@dataclass(frozen=True)
class BodyPace:
    """How an upload's body must arrive: its first bytes within ``timeout_s`` of the request, then on average at
    least ``min_rate`` bytes per second: byte n is due ``timeout_s + n / min_rate`` seconds after the request, and
    every byte within ``max_s`` of it. A body that stalls, or trickles (a few bytes now and then, to keep a slot),
    misses its due time and is dropped; one paced just above ``min_rate`` holds its slot for ``max_s`` at most.

    Until its first bytes arrive an upload holds no slot but does hold one of the thread pool's threads (the routes
    are sync), for at most ``timeout_s``: the header phase and the other routes' bodies have no timeout of this kind
    (uvicorn has none to set), a known limit."""

    timeout_s: float
    min_rate: float
    max_s: float = float("inf")

    @classmethod
    def of(cls, settings: Settings) -> BodyPace:
        return cls(settings.upload_body_timeout_s, settings.upload_min_bytes_per_s, settings.upload_max_body_s)

    def due(self, start: float, received: int) -> float:
        """When the next bytes must have arrived (``time.monotonic``), ``received`` bytes into the body."""
        return start + min(self.timeout_s + received / self.min_rate, self.max_s)


class BodyStalled(Exception):
    """Raised from ``receive`` when the body misses its due time (``BodyPace``)."""


def _body_stopped(request: Request, why: str) -> HTTPException:
    """One WARNING line in the log (not a traceback) and a 408: the client is gone or too slow to wait for."""
    log.warning("upload %s %s: %s; its slot is given back", request.method, request.url.path, why)
    return HTTPException(
        status.HTTP_408_REQUEST_TIMEOUT, f"the upload's body {why}; retry", headers={"Connection": "close"}
    )


def read_parts(
    request: Request,
    limit: int,
    names: tuple[str, ...],
    optional: tuple[str, ...] = (),
    pace: BodyPace | None = None,
    slot: Slot | None = None,
    held: ExitStack | None = None,
):
    """Read the multipart body (from the request's thread, on the event loop) → (form, {name: part}).

    413 past ``limit`` (``server.limits.upload_body_limit``) by Content-Length; ``slot()`` is entered (into
    ``held``, which the caller closes) when the first bytes of the body arrive, and may refuse with 429; 408 when
    the body misses its ``pace`` or the client disconnects (one WARNING line, the slot given back at once); 422
    for any body that is not a multipart upload of file parts ``names`` (not multipart, a text part, more parts than
    ``names``, a part twice, an unknown part, a part without a name: Starlette's 400 is caught as the base class it
    is, not FastAPI's ``HTTPException``), 422 naming a missing part (those in ``optional`` may be absent)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, f"request body over {limit} bytes allowed for this job")
    held = held if held is not None else ExitStack()
    paced = request if pace is None and slot is None else Request(request.scope, _paced(request, pace, slot, held))
    try:
        form = anyio.from_thread.run(partial(paced.form, max_files=len(names), max_fields=0))
    except BodyStalled:
        held.close()
        assert pace is not None  # only a paced body stalls
        rule = (
            f"did not arrive in time (from {pace.timeout_s:g} s after the head, at {pace.min_rate:g} bytes/s, "
            f"all of it within {pace.max_s:g} s)"
        )
        raise _body_stopped(request, rule) from None
    except ClientDisconnect:
        held.close()
        raise _body_stopped(request, "ended: the client disconnected before sending all of it") from None
    except StarletteHTTPException as exc:  # Starlette's 400 for a body that is not a multipart upload of ``names``
        held.close()
        if exc.status_code != status.HTTP_400_BAD_REQUEST:
            raise  # our 413 (``server.limits.BodyTooLarge``) as the body passes the cap, a 429 from ``slot``
        rule = f"must be a multipart upload of at most {len(names)} file parts ({', '.join(names)}), each once"
        raise field_error("request", rule) from None
    except BaseException:
        held.close()
        raise
    problem = _parts_problem(form, names, optional)
    if problem is not None:
        close_form(form)
        held.close()
        raise field_error(*problem)
    return form, {name: form[name] for name in names if isinstance(form.get(name), UploadFile)}


def _paced(request: Request, pace: BodyPace | None, slot: Slot | None, held: ExitStack):
    """The request's ``receive``, raising ``BodyStalled`` past the body's due time and entering ``slot`` when the
    first bytes of the body arrive."""
    upstream = request.receive
    start, received, holding = time.monotonic(), 0, False

    async def receive() -> Message:
        nonlocal received, holding
        if pace is None:
            message = await upstream()
        else:
            try:
                with anyio.fail_after(max(pace.due(start, received) - time.monotonic(), 0.001)):
                    message = await upstream()
            except TimeoutError:
                raise BodyStalled from None
        body = message.get("body", b"")
        if body and not holding and slot is not None:
            held.enter_context(slot())  # 429 when none is free: raised into the parser, which lets it through
            holding = True
        received += len(body)
        return message

    return receive


def _parts_problem(form: FormData, names: tuple[str, ...], optional: tuple[str, ...]) -> tuple[str, str] | None:
    """(field, rule) of what is wrong with the parts, None when each of ``names`` is a file part sent once (those
    in ``optional`` may be absent) and there is nothing else."""
    if not set(form.keys()) <= set(names):
        return "request", f"takes only the parts {', '.join(names)}"
    for name in names:
        if len(form.getlist(name)) > 1:
            return name, "a part may be sent once"
        part = form.get(name)
        if not isinstance(part, UploadFile) and (name not in optional or part is not None):
            return name, "missing file part"
    return None


def close_form(form: FormData) -> None:
    anyio.from_thread.run(form.close)


@contextmanager
def received_parts(
    request: Request,
    store: ArtifactStore,
    limit: int,
    names: tuple[str, ...],
    optional: tuple[str, ...] = (),
    pace: BodyPace | None = None,
    slot: Slot | None = None,
) -> Iterator[tuple[dict[str, UploadFile], Path]]:
    """An upload's parts (``read_parts``: the body read at ``pace``, ``slot`` held from its first bytes) and a
    private spool folder under the store's ``tmp/`` → (parts, folder); afterwards, however the block ends, the
    folder is removed, the form's files are closed and the slot is given back."""
    with ExitStack() as held:
        form, parts = read_parts(request, limit, names, optional, pace, slot, held)
        try:
            tmp = store.tmp_dir()
            try:
                yield parts, tmp
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        finally:
            close_form(form)


def spool_part(store: ArtifactStore, tmp: Path, part: UploadFile, limit: int, name: str) -> Path:
    """The part copied to ``tmp/name``; 413 naming it when it is larger than ``limit``."""
    if not store.spool(part.file, limit, tmp / name):
        raise field_error(name, f"larger than {limit} bytes allowed for this job", status.HTTP_413_CONTENT_TOO_LARGE)
    return tmp / name


@dataclass
class Upload:
    """The spooled, checked parts of one upload."""

    b_path: Path | None  # None: a log-only upload
    log_path: Path
    b_sha256: str | None
    log_sha256: str
    metrics: dict[str, Any]


def receive(store: ArtifactStore, tmp: Path, spec: JobSpec, d: int, parts: dict[str, UploadFile]) -> Upload:
    """Spool the parts of a job's result or a round client's log under their limits and run the checks that need no
    torch: B's form (when the job takes one), the log's line count against the steps, the metrics object."""
    if spec.upload == "log" and "b_flat" in parts:
        raise field_error("b_flat", "this job takes the log alone (upload: log); the server replays it")
    if spec.upload == "full" and "b_flat" not in parts:
        raise field_error("b_flat", "missing file part")
    b_path = spool_part(store, tmp, parts["b_flat"], b_limit(d), "b_flat") if "b_flat" in parts else None
    log_path = spool_part(store, tmp, parts["log"], log_limit(spec), "log")
    metrics_path = spool_part(store, tmp, parts["metrics"], METRICS_LIMIT, "metrics")
    try:
        if b_path is not None:
            check_b(b_path, d)
        check_step_count(log_path, spec)
        metrics = parse_metrics(metrics_path.read_bytes(), private=spec.privacy is not None)
    except ResultRejected as exc:
        raise field_error(exc.field, exc.message) from None
    b_sha = None if b_path is None else sha256_file(b_path)
    return Upload(b_path, log_path, b_sha, sha256_file(log_path), metrics)


def _verifying() -> HTTPException:
    return try_later(status.HTTP_429_TOO_MANY_REQUESTS, "this user's devices already have results being verified", 10)


def refuse_while_verifying(pool: WorkerPool, owner: int) -> None:
    """429, before any of the body is read, when ``owner`` has ``verify_per_user`` verifications running or waiting:
    the upload would be refused at its verification anyway (``run_verification``), and reading it first cost the
    API process the whole body (2.4 MB for a forged 20,000-step log) for every retry of every device of that user
    (``benchmarks/fairness.py``)."""
    if pool.owner_full(owner):
        raise _verifying()


def run_verification(pool: WorkerPool, settings: Settings, owner: int | None, fn: Callable[..., Any], *args: Any):
    """``fn(*args)`` in a verify worker. A rejection is a 422 naming the part; at most ``verify_per_user``
    verifications per user run or wait (429 past that); a replay that runs past ``verify_timeout_s`` is stopped and
    answers 503, as does a worker that died: neither says the upload is bad."""
    try:
        with metrics.VERIFY_SECONDS.time():
            return pool.run(fn, *args, timeout=settings.verify_timeout_s, owner=owner)
    except ResultRejected as exc:
        raise field_error(exc.field, exc.message) from None
    except OwnerBusy:
        raise _verifying() from None
    except WorkTimedOut:
        raise try_later(
            status.HTTP_503_SERVICE_UNAVAILABLE, f"verification ran past {settings.verify_timeout_s:g} s", 60
        ) from None
    except WorkerDied:
        raise try_later(status.HTTP_503_SERVICE_UNAVAILABLE, "the verification worker died; retry", 10) from None
