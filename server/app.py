"""The FastAPI application: ``create_app(settings)`` wires the database, the store, the queues and the routers.

On start (lifespan) it takes the data dir's lock (with the in-process compile queue: a second server on the same
data dir refuses to start before touching any job) and empties the upload spool, migrates the database, resubmits
jobs a previous run left queued or compiling, and starts the lease sweeper; on stop it shuts the worker pools
down. Nothing here imports torch: compilation and replay run in worker processes (``server.compile``,
``server.verify``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from sqlalchemy.orm import Session, sessionmaker
from starlette.exceptions import HTTPException as StarletteHTTPException

from server import jobstate
from server.compile_queue import CompileQueue, LocalCompileQueue, PausedCompileQueue
from server.db import make_engine, make_sessionmaker, migrate
from server.limits import BodyLimits, UploadSlots
from server.pool import WorkerPool
from server.responses import http_error, validation_error
from server.routes import adapters, devices, enrollment, health, jobs, leases, models, programs, results, users
from server.settings import Settings, get_settings
from server.store import ArtifactStore

log = logging.getLogger(__name__)
QueueFactory = Callable[[sessionmaker[Session], ArtifactStore, Settings], CompileQueue]


def _default_queue(sessions: sessionmaker[Session], store: ArtifactStore, settings: Settings) -> CompileQueue:
    if settings.compile_paused:
        return PausedCompileQueue()
    return LocalCompileQueue(sessions, store, settings.compile_workers)


def _sweep_leases(sessions: sessionmaker[Session], settings: Settings, stop: threading.Event) -> None:
    """Return expired leases to ``ready`` even when no device is asking for work."""
    interval = max(1.0, min(10.0, settings.lease_s / 5))
    while not stop.wait(interval):
        try:
            with sessions() as session:
                jobstate.expire_leases(session, settings.max_attempts)
                session.commit()
        except Exception:  # a database hiccup must not kill the sweeper
            log.exception("lease sweep failed")


def create_app(settings: Settings | None = None, queue_factory: QueueFactory | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = ArtifactStore(settings.data_dir)
        lock = None
        if queue_factory is None:  # the in-process queue: this process alone may run jobs from this data dir
            lock = store.lock()  # before the database, recover() or the spool are touched
            cleaned = store.clean_tmp()
            if cleaned:
                log.info("removed %d stale spool and build entries", cleaned)
        engine = make_engine(settings.db_url)
        migrate(engine)
        sessions = make_sessionmaker(engine)
        queue = (queue_factory or _default_queue)(sessions, store, settings)
        app.state.settings, app.state.sessionmaker, app.state.store = settings, sessions, store
        app.state.compile_queue, app.state.verify_pool = (
            queue,
            WorkerPool(settings.verify_workers, per_owner=settings.verify_per_user),
        )
        app.state.upload_slots = UploadSlots(settings.max_uploads, settings.max_uploads_per_device)
        queue.recover()
        stop = threading.Event()
        sweeper = threading.Thread(target=_sweep_leases, args=(sessions, settings, stop), daemon=True)
        sweeper.start()
        try:
            yield
        finally:
            stop.set()
            queue.close()
            app.state.verify_pool.close()
            sweeper.join(timeout=5)
            engine.dispose()
            if lock is not None:
                lock.close()

    app = FastAPI(
        title="mobizo",
        summary="On-device LLM personalization: jobs, device programs and the adapter registry",
        version="0.1.0",
        lifespan=lifespan,
    )
    for module in (health, users, models, enrollment, devices, jobs, leases, programs, results, adapters):
        app.include_router(module.router)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_middleware(BodyLimits, upload_limit=int(settings.max_upload_mb * 1024 * 1024))
    return app
