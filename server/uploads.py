"""Receiving a device's multipart upload (a job's result, a round client's log): reading the parts, spooling each
under its limit, and running the torch-side check in a verify worker with its failures mapped onto answers.

One home for what ``routes/results.py`` and ``routes/rounds.py`` both do, so that a log-only upload is received
exactly like a full one.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import anyio.from_thread
from fastapi import HTTPException, Request, status
from starlette.datastructures import FormData, UploadFile

from server.pool import OwnerBusy, WorkerDied, WorkerPool, WorkTimedOut
from server.responses import field_error, try_later
from server.settings import Settings
from server.store import ArtifactStore
from server.verify import ResultRejected

MULTIPART_OVERHEAD = 64 * 1024  # boundaries and part headers


def read_parts(request: Request, limit: int, names: tuple[str, ...], optional: tuple[str, ...] = ()):
    """Read the multipart body (from the request's thread, on the event loop) → (form, {name: part}); 413 past
    ``limit`` by Content-Length, 422 naming a missing part (those in ``optional`` may be absent)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, f"request body over {limit} bytes allowed for this job")
    try:
        form = anyio.from_thread.run(partial(request.form, max_files=len(names), max_fields=0))
    except HTTPException as exc:  # Starlette's 400 for a body that is not valid multipart
        if exc.status_code != status.HTTP_400_BAD_REQUEST:
            raise
        raise field_error("request", f"not a multipart upload of {', '.join(names)}: {exc.detail}") from None
    parts: dict[str, UploadFile] = {}
    for name in names:
        part = form.get(name)
        if isinstance(part, UploadFile):
            parts[name] = part
        elif name not in optional or part is not None:
            close_form(form)
            raise field_error(name, "missing file part")
    return form, parts


def close_form(form: FormData) -> None:
    anyio.from_thread.run(form.close)


@contextmanager
def received_parts(
    request: Request, store: ArtifactStore, limit: int, names: tuple[str, ...], optional: tuple[str, ...] = ()
) -> Iterator[tuple[dict[str, UploadFile], Path]]:
    """An upload's parts (``read_parts``) and a private spool folder under the store's ``tmp/`` → (parts, folder);
    afterwards, however the block ends, the folder is removed and the form's files are closed."""
    form, parts = read_parts(request, limit, names, optional)
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


def run_verification(pool: WorkerPool, settings: Settings, owner: int | None, fn: Callable[..., Any], *args: Any):
    """``fn(*args)`` in a verify worker. A rejection is a 422 naming the part; at most ``verify_per_user``
    verifications per user run or wait (429 past that); a replay that runs past ``verify_timeout_s`` is stopped and
    answers 503, as does a worker that died: neither says the upload is bad."""
    try:
        return pool.run(fn, *args, timeout=settings.verify_timeout_s, owner=owner)
    except ResultRejected as exc:
        raise field_error(exc.field, exc.message) from None
    except OwnerBusy:
        raise try_later(
            status.HTTP_429_TOO_MANY_REQUESTS, "this user's devices already have results being verified", 10
        ) from None
    except WorkTimedOut:
        raise try_later(
            status.HTTP_503_SERVICE_UNAVAILABLE, f"verification ran past {settings.verify_timeout_s:g} s", 60
        ) from None
    except WorkerDied:
        raise try_later(status.HTTP_503_SERVICE_UNAVAILABLE, "the verification worker died; retry", 10) from None
