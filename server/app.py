"""The FastAPI application: ``create_app(settings)`` wires the database, the store, the queues and the routers.

On start (lifespan) it takes the data dir's lock (with the in-process compile queue: a second server on the same
data dir refuses to start before touching any job) and empties the upload spool, migrates the database, resubmits
jobs a previous run left queued or compiling, and starts the lease sweeper; on stop it shuts the worker pools down.
With ``MOBIZO_QUEUE=celery`` the data dir is shared with the workers and with other API processes: there is no file
lock; migration and recovery run under the database's startup lock (``server.db.startup_lock``) and only the
first of the processes starting together recovers, removing only spool and build entries older than a day. Every
process runs a lease sweeper: its transitions are conditional UPDATEs, so sweeps never conflict. Nothing here
imports torch: compilation and replay run in worker processes (``server.compile``, ``server.verify``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker
from starlette.exceptions import HTTPException as StarletteHTTPException

from server import accounts, federation, responses
from server.compile import build_program
from server.compile_queue import CompileQueue, LocalCompileQueue, PausedCompileQueue
from server.dashboard import PREFIX, create_dashboard
from server.dashboard.web import SignInThrottle
from server.db import make_engine, make_sessionmaker, migrate, startup_lock
from server.inference_builds import Bounds, InferenceBuilds
from server.limits import BodyLimits, RefusedUploads, UploadSlots
from server.lru import LRUCache
from server.merged_builds import MB, MergeBounds, MergedBuilds
from server.metrics import RequestMetrics, app_registry, serve_metrics
from server.object_store import shared_objects
from server.pace import Pace
from server.pool import WorkerPool
from server.privacy import ACCOUNTANT_PRELOAD, Accountant
from server.routes import (
    adapters,
    blobs,
    cohorts,
    devices,
    enrollment,
    health,
    inference,
    jobs,
    leases,
    metrics,
    models,
    privacy,
    rounds,
    users,
    work,
)
from server.settings import Settings, get_settings
from server.state.closes import reopen_closing_rounds
from server.state.leases import sweep_leases
from server.store import ArtifactStore

if TYPE_CHECKING:
    from server.celery_queue import CeleryVerifyPool

log = logging.getLogger(__name__)
VERIFY_PRELOAD = ("server.verify", "shared.replay")  # what a verify worker imports before its first replay
STALE_TMP_S = 24 * 3600  # with a shared data dir, spool and build entries this old belong to no live upload or export
QueueFactory = Callable[[sessionmaker[Session], ArtifactStore, Settings], CompileQueue]


def _default_queue(sessions: sessionmaker[Session], store: ArtifactStore, settings: Settings) -> CompileQueue:
    if settings.compile_paused:
        return PausedCompileQueue()
    if settings.queue == "celery":
        from server.celery_queue import CeleryCompileQueue  # Celery is imported only by servers that use it

        return CeleryCompileQueue(sessions, settings)
    build = partial(build_program, memory_mb=settings.compile_memory_mb)
    return LocalCompileQueue(sessions, store, settings.compile_workers, build)


def _verify_pool(settings: Settings) -> WorkerPool | CeleryVerifyPool:
    """Replays run in this server's worker processes, or (``MOBIZO_QUEUE=celery``) on the verify queue's workers."""
    if settings.queue == "celery":
        from server.celery_queue import CeleryVerifyPool

        return CeleryVerifyPool(settings)
    # The replay's imports (torch) happen when a worker starts, not inside an upload's verify_timeout_s.
    return WorkerPool(settings.verify_workers, per_owner=settings.verify_per_user, preload=VERIFY_PRELOAD)


def _sweep_leases(sessions: sessionmaker[Session], settings: Settings, stop: threading.Event) -> None:
    """Return expired leases to ``ready`` even when no device is asking for work."""
    interval = max(1.0, min(10.0, settings.lease_s / 5))
    while not stop.wait(interval):
        try:
            with sessions() as session:
                sweep_leases(session, settings.max_attempts)
        except Exception:  # a database hiccup must not kill the sweeper
            log.exception("lease sweep failed")


ROUND_SWEEP_S = 0.5


def _sweep_rounds(state: Any, stop: threading.Event) -> None:
    """Close, reopen or fail federated rounds at their deadline, even when no device is asking for work, every
    ``ROUND_SWEEP_S`` and at once when a report fills a round (``state.round_sweep`` set: the device that sent it
    is not kept waiting for the close). The pool is looked up on each sweep: tests swap it."""
    due = state.round_sweep
    while not stop.is_set():
        due.wait(ROUND_SWEEP_S)
        due.clear()
        if stop.is_set():
            return
        try:
            with state.sessionmaker() as session:
                federation.sweep(session, state.store, state.verify_pool, state.settings)
        except Exception:  # a database hiccup must not kill the sweeper
            log.exception("round sweep failed")


def _fill_state(
    state: Any, settings: Settings, store: ArtifactStore, engine: Engine, sessions: Any, queue: Any
) -> None:
    """What the routes find on ``app.state``: the settings, the database, the store, the queues and pools, the
    caches and the bounds on concurrent work."""
    state.settings, state.engine, state.sessionmaker = settings, engine, sessions
    state.store = store
    state.device_tokens, state.program_manifests = LRUCache(100_000), LRUCache(1_000)
    state.job_specs = LRUCache(10_000)  # a job's parsed spec, by id (``server.views.job_spec``)
    state.pace = Pace()
    state.seen = accounts.SeenMemo()  # when each device was last recorded as seen by a heartbeat
    state.round_sweep = threading.Event()  # set: the round sweeper runs now (a report filled a round)
    state.compile_queue, state.verify_pool = queue, _verify_pool(settings)
    per = (settings.max_uploads_per_device, settings.max_uploads_per_user)
    state.upload_slots = UploadSlots(settings.max_uploads, *per)
    state.sign_in_throttle = SignInThrottle(settings)
    bounds = Bounds(settings.inference_builds, settings.inference_builds_per_user, settings.inference_builds_per_device)
    state.inference_builds = InferenceBuilds(store, queue, settings.compile_workers, bounds, settings.compile_paused)
    kept = (int(settings.merged_per_user_mb * MB), int(settings.merged_total_mb * MB))
    merges = MergeBounds(*kept, settings.merged_builds, settings.merged_builds_per_user)
    state.merged_builds = MergedBuilds(sessions, store, queue, merges, settings.compile_paused)
    state.metrics_registry = app_registry(engine)
    accounting = WorkerPool(settings.privacy_workers, preload=ACCOUNTANT_PRELOAD)  # started at the first private submit
    state.accountant = Accountant(accounting, settings.private_submits_per_user, settings.privacy_timeout_s)


def _serve_metrics(state: Any, settings: Settings) -> Any:
    """The Prometheus port's server, or None (no port set, or another API process serves it)."""
    if settings.metrics_port is None:
        return None
    try:
        return serve_metrics(state.metrics_registry, settings.metrics_port, settings.metrics_host)
    except OSError as error:  # with --workers N, the first API process to start serves the port
        log.warning("metrics port %d not served by this process: %s", settings.metrics_port, error)
        return None


def _start_up(state: Any, queue: Any, owns_data_dir: bool) -> None:
    """Migrate, then, in the one process that starts first (or owns the data dir), recover: unfinished jobs
    resubmitted, stale spool entries removed, rounds left mid-close closed again."""
    engine, settings, store = state.engine, state.settings, state.store
    with startup_lock(engine) as first:  # several API processes: one migrates and recovers, the rest wait
        migrate(engine)
        with state.sessionmaker() as session:  # the same key in every process: made once, kept in the database
            state.sign_in_key = accounts.server_key(session, "sign_in")
        if not (owns_data_dir or first):
            log.info("startup: another API process started at the same time and recovered the jobs")
            return
        if not owns_data_dir:  # shared data dir: only what no live process can still be using
            store.clean_tmp(older_than_s=STALE_TMP_S)
        state.merged_builds.remove_unrecorded(older_than_s=0 if owns_data_dir else STALE_TMP_S)
        log.info("startup: resubmitted %d unfinished jobs", queue.recover())
        if settings.queue == "local":  # one server per database: nobody else can be closing a round
            with state.sessionmaker() as session:
                reopened = reopen_closing_rounds(session)
            if reopened:
                log.info("startup: %d rounds left mid-close will be closed again", reopened)


def _lifespan(settings: Settings, queue_factory: QueueFactory | None):
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = ArtifactStore(settings.data_dir, shared_objects(settings.store_url))
        lock = None
        if queue_factory is None and settings.queue == "local":  # this process alone runs jobs from this data dir
            lock = store.lock()  # before the database, recover() or the spool are touched
            cleaned = store.clean_tmp()
            if cleaned:
                log.info("removed %d stale spool and build entries", cleaned)
        engine = make_engine(settings.db_url)
        sessions = make_sessionmaker(engine)
        queue = (queue_factory or _default_queue)(sessions, store, settings)
        _fill_state(app.state, settings, store, engine, sessions, queue)
        metrics_server = _serve_metrics(app.state, settings)
        _start_up(app.state, queue, owns_data_dir=lock is not None)
        stop = threading.Event()
        sweepers = [
            threading.Thread(
                target=_sweep_leases, args=(app.state.sessionmaker, settings, stop), name="lease-sweeper", daemon=True
            ),
            threading.Thread(target=_sweep_rounds, args=(app.state, stop), name="round-sweeper", daemon=True),
        ]
        for sweeper in sweepers:
            sweeper.start()
        try:
            yield
        finally:
            stop.set()
            app.state.round_sweep.set()  # the round sweeper sees the stop at once
            queue.close()
            app.state.verify_pool.close()
            app.state.accountant.close()
            app.state.inference_builds.close()
            app.state.merged_builds.close()
            for sweeper in sweepers:
                sweeper.join(timeout=5)
            if metrics_server is not None:
                metrics_server.shutdown()
                metrics_server.server_close()
            engine.dispose()
            if lock is not None:
                lock.close()

    return lifespan


def create_app(settings: Settings | None = None, queue_factory: QueueFactory | None = None) -> FastAPI:
    settings = settings or get_settings()
    app = FastAPI(
        title="mobizo",
        summary="On-device LLM personalization: jobs, device programs and the adapter registry",
        version="0.1.0",
        lifespan=_lifespan(settings, queue_factory),
    )
    for module in (
        health,
        users,
        models,
        enrollment,
        devices,
        jobs,
        leases,
        blobs,
        work,
        adapters,
        cohorts,
        rounds,
        inference,
        privacy,
        metrics,
    ):
        app.include_router(module.router)
    app.add_exception_handler(RequestValidationError, responses.validation_error)
    app.add_exception_handler(StarletteHTTPException, responses.http_error)
    app.mount(PREFIX, create_dashboard(app.state))  # pages for people, with their own error pages
    app.add_middleware(BodyLimits, upload_limit=int(settings.max_upload_mb * 1024 * 1024))
    app.add_middleware(RefusedUploads, delay_s=settings.upload_refusal_delay_s)  # sees every refusal
    app.add_middleware(RequestMetrics)  # outermost: counts every answer, the other middlewares' too
    return app
