"""The queues of ``MOBIZO_QUEUE=celery``: the Celery application, its tasks (run by ``mobizo worker``) and the
``CompileQueue`` the API processes use to send them.

Compile and verify are separate queues (``COMPILE_QUEUE``, ``VERIFY_QUEUE``), so a five-minute export never
delays a 50 ms replay: a worker started with ``--queues verify`` takes replays only. The compile queue takes both
kinds of export: a job's training program (``COMPILE_TASK``) and an inference program (``INFERENCE_TASK``, whose
manifest comes back through the result backend while the files go to the store). Tasks are acknowledged late
and rejected (hence redelivered) when the process running them is lost (``task_reject_on_worker_lost``): a worker
killed mid-export leaves its task to the next worker. When that happens depends on the broker:

* Redis redelivers a task that stays unacknowledged for the visibility timeout
  (``MOBIZO_BROKER_VISIBILITY_TIMEOUT_S``, 2 h by default), found by a worker's sweep of the unacknowledged tasks
  (``redis_transport_options``). It must exceed the longest export, or a live export is delivered, and started, a
  second time.
* RabbitMQ redelivers as soon as the dead worker's connection drops; a delivery left unacknowledged longer than
  the broker's ``consumer_timeout`` (30 min by default) closes the channel, so that must exceed the longest export.

Verification keeps the upload synchronous: the route sends the replay to the verify queue and waits for its result
(``CeleryVerifyPool``, the verify pool's interface), so a device still gets 201 or a 422 naming the bad part in
the same response, as with the local pool. The spooled parts and the replay's output live in the data dir, which
workers share with the servers (a shared volume, mounted at the same path), or, with a bucket
(``MOBIZO_STORE_URL``), travel through it (``server.verify_spool``), so that a worker needs no shared volume at
all. The result travels through the result backend (``Settings.result_backend``).

Tasks are idempotent: every change of a job goes through a conditional transition of ``server.state``, so a
duplicate delivery finds the job no longer ``queued`` and does nothing, while a redelivery (the broker's
``redelivered`` flag) takes over the job its dead worker left ``compiling``. A cancel revokes the task by its id
(``compile-<job id>``) with SIGKILL: a waiting task is dropped and a running export's process is killed.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Any

from celery import Celery, Task
from celery.result import AsyncResult
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from server import verify_spool
from server.compile import build_program
from server.compile_queue import compile_job, export_inference, export_merged
from server.db import make_engine, make_sessionmaker
from server.object_store import shared_objects
from server.pool import OwnerBusy, WorkerDied, WorkTimedOut
from server.settings import Settings
from server.state import jobs
from server.state.jobs import CompileInput
from server.store import ArtifactStore
from server.verify import ResultRejected, package_adapter, replay_log_only, verify_and_package

log = logging.getLogger(__name__)
COMPILE_QUEUE, VERIFY_QUEUE = "compile", "verify"
COMPILE_TASK, VERIFY_TASK, INFERENCE_TASK = "mobizo.compile", "mobizo.verify", "mobizo.compile_inference"
MERGE_TASK = "mobizo.merge"
# Every function the server hands its verify pool (``server.uploads.run_verification``, the round close of
# ``server.federation``), by name: a task names its function, it never carries pickled code.
VERIFY_FUNCTIONS: dict[str, Callable[..., Any]] = {
    fn.__name__: fn for fn in (verify_and_package, replay_log_only, package_adapter)
}
RESULT_POLL_S = 0.02  # how often a waiting upload looks for its verification result
QUEUES = (COMPILE_QUEUE, VERIFY_QUEUE)


def _call(fn: Callable[..., Any], *args: Any, key: Hashable | None = None) -> Any:
    """``fn(*args)`` here: a worker's task runs its export in its own process (a pool's ``run`` without the pool)."""
    return fn(*args)


def wait_result(app: Celery, result: AsyncResult, timeout: float | None) -> Any:
    """Poll the result backend for a task's return value (thread-safe, unlike the backend's push consumer shared by
    request threads). Past ``timeout`` the task is revoked, its process killed: ``WorkTimedOut``; a task that
    raised: ``WorkerDied`` with its error."""
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while not result.ready():
            if deadline is not None and time.monotonic() > deadline:
                app.control.revoke(result.id, terminate=True, signal="SIGKILL")
                raise WorkTimedOut(f"the task ran past its timeout of {timeout:g} s and was stopped")
            time.sleep(RESULT_POLL_S)
        if not result.successful():
            raise WorkerDied(f"the task failed: {result.state} {result.result!r}"[:500])
        return result.result
    finally:
        result.forget()


def compile_task_id(job_id: int) -> str:
    """One task id per job, so that a cancel revokes every delivery of it (a resubmission included)."""
    return f"compile-{job_id}"


class _WorkerResources:
    """The database and store of a worker process, made on first use: in the pool process, after the fork
    (a connection pool inherited across a fork would share sockets between processes)."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._pid: int | None = None
        self._sessions: sessionmaker[Session] | None = None
        self._store: ArtifactStore | None = None

    def get(self) -> tuple[sessionmaker[Session], ArtifactStore]:
        if self._pid != os.getpid() or self._sessions is None or self._store is None:
            self._sessions = make_sessionmaker(make_engine(self._settings.db_url))
            self._store = ArtifactStore(self._settings.data_dir, shared_objects(self._settings.store_url))
            self._pid = os.getpid()
        return self._sessions, self._store


def redis_transport_options(visibility_timeout_s: int) -> dict[str, int]:
    """Kombu's Redis options: the visibility timeout, and a sweep for tasks past it every fifth of it, at most every
    10 s. Kombu's own default sweeps every 10 s but scans only at every 10th sweep, so a lost task would wait up to
    100 s past its timeout; a scan is one ZRANGE on the broker."""
    return {
        "visibility_timeout": visibility_timeout_s,
        "unacked_restore_interval": max(1, min(10, visibility_timeout_s // 5)),
        "unacked_restore_throttle": 1,
    }


def make_celery(settings: Settings) -> Celery:
    """The Celery application for ``settings.broker_url``, with the compile and verify tasks registered."""
    if not settings.broker_url:
        raise ValueError("MOBIZO_BROKER_URL is not set (needed with MOBIZO_QUEUE=celery)")
    if not settings.result_backend or not settings.result_backend.startswith(("redis://", "rediss://")):
        raise ValueError("MOBIZO_RESULT_BACKEND_URL must name a Redis (needed with a broker other than Redis)")
    app = Celery("mobizo", broker=settings.broker_url, backend=settings.result_backend, set_as_current=False)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,  # a worker holds no task it is not running: a free worker takes the next one
        task_ignore_result=True,  # job state lives in the database; only verification returns a result
        result_expires=3600,
        task_routes={
            COMPILE_TASK: {"queue": COMPILE_QUEUE},
            INFERENCE_TASK: {"queue": COMPILE_QUEUE},
            MERGE_TASK: {"queue": COMPILE_QUEUE},
            VERIFY_TASK: {"queue": VERIFY_QUEUE},
        },
        task_default_queue=COMPILE_QUEUE,
        task_serializer="json",
        accept_content=["json"],
        broker_transport_options=redis_transport_options(settings.broker_visibility_timeout_s),
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    resources = _WorkerResources(settings)

    @app.task(name=COMPILE_TASK, bind=True, autoretry_for=(OperationalError,), retry_backoff=True, max_retries=10)
    def compile_program(task: Task, job_id: int) -> None:
        """Compile one job (``compile_job``); a database that cannot be reached retries the task with backoff.
        A redelivery, or a retry (which may follow a move to ``compiling``), takes over a compiling job."""
        sessions, store = resources.get()
        redelivered = bool((task.request.delivery_info or {}).get("redelivered")) or task.request.retries > 0

        def export(work: CompileInput) -> dict[str, Any]:
            programs, blobs = str(store.programs_dir), str(store.blobs_dir)
            built = build_program(
                work.model_dir,
                work.model_sha256,
                work.spec,
                programs,
                blobs,
                memory_mb=settings.compile_memory_mb,
                fetch=store.fetch_program,
            )
            store.publish_program(built["key"], built["manifest"])
            return built

        compile_job(sessions, job_id, export, resume=redelivered)

    @app.task(name=INFERENCE_TASK, ignore_result=False)
    def compile_inference(model_dir: str, model_sha256: str, config: dict[str, Any], key: str) -> dict[str, Any]:
        """Export the inference program ``key`` into the store (``export_inference``) → its manifest."""
        store = resources.get()[1]
        return export_inference(store, _call, model_dir, model_sha256, config, key)

    @app.task(name=MERGE_TASK, ignore_result=False)
    def merge(model_dir: str, archive_sha256: str, dtype: str, key: str) -> dict[str, Any]:
        """Fold an adapter into its base and keep the zip in the store (``export_merged``) → its sha256 and size."""
        store = resources.get()[1]
        return export_merged(store, _call, model_dir, archive_sha256, dtype, key)

    @app.task(name=VERIFY_TASK, ignore_result=False, time_limit=settings.verify_timeout_s)
    def verify(name: str, args: list[Any], spool: str | None = None) -> dict[str, Any]:
        """``VERIFY_FUNCTIONS[name](*args)`` → ``{"ok": its result}``, or ``{"rejected": [field, message]}`` for a
        bad result (an answer, not a failure of the task). Past ``verify_timeout_s`` the worker kills the process.
        With ``spool`` the files travel through the bucket (``server.verify_spool``), not the data dir."""
        fn = VERIFY_FUNCTIONS[name]
        try:
            if spool is None:
                return {"ok": fn(*args)}
            store = resources.get()[1]
            local = store.tmp_dir()
            try:
                local_args, out = verify_spool.receive_args(store.shared, args, local)
                return {"ok": verify_spool.send_result(store.shared, spool, args, fn(*local_args), out)}
            finally:
                shutil.rmtree(local, ignore_errors=True)
        except ResultRejected as exc:
            return {"rejected": [exc.field, exc.message]}

    return app


class CeleryCompileQueue:
    """``CompileQueue`` over Celery: ``submit`` sends a task to the compile queue, ``cancel`` revokes it."""

    def __init__(self, sessions: sessionmaker[Session], settings: Settings) -> None:
        self._sessions = sessions
        self._app = make_celery(settings)

    def submit(self, job_id: int) -> None:
        self._app.send_task(COMPILE_TASK, args=[job_id], task_id=compile_task_id(job_id), queue=COMPILE_QUEUE)

    def cancel(self, job_id: int) -> None:
        """Drop the task if it waits; kill the process exporting it if it runs (the job is already cancelled)."""
        self._app.control.revoke(compile_task_id(job_id), terminate=True, signal="SIGKILL")

    def recover(self) -> int:
        """Resubmit queued jobs (the server may have stopped before handing one to the broker); a duplicate finds
        its job no longer queued and does nothing. Compiling jobs are the broker's to redeliver."""
        with self._sessions() as session:
            ids = jobs.queued_ids(session)
        for job_id in ids:
            self.submit(job_id)
        return len(ids)

    def build_inference(self, model_dir: str, model_sha256: str, config: dict[str, Any], key: str) -> dict[str, Any]:
        """Send the export to the compile queue's workers and wait for it (in ``InferenceBuilds``' driver thread)."""
        args = [model_dir, model_sha256, config, key]
        return wait_result(self._app, self._app.send_task(INFERENCE_TASK, args=args, queue=COMPILE_QUEUE), None)

    def build_merged(self, model_dir: str, archive_sha256: str, dtype: str, key: str) -> dict[str, Any]:
        """Send the merge to the compile queue's workers and wait for it (in ``MergedBuilds``' driver thread)."""
        args = [model_dir, archive_sha256, dtype, key]
        return wait_result(self._app, self._app.send_task(MERGE_TASK, args=args, queue=COMPILE_QUEUE), None)

    def close(self) -> None:
        self._app.close()


class SharedOwnerLimit:
    """``server.pool.OwnerLimit`` counted in Redis (the result backend), so that ``verify_per_user`` holds across
    API processes and machines. A process killed while holding a place leaves it taken until the key expires
    (``ttl_s`` after that user's last verification began)."""

    def __init__(self, redis_url: str, per_owner: int, ttl_s: int) -> None:
        import redis

        self._redis = redis.Redis.from_url(redis_url)
        self._per_owner, self._ttl_s = per_owner, ttl_s

    def full(self, owner: Hashable) -> bool:
        return int(self._redis.get(f"mobizo:verifying:{owner}") or 0) >= self._per_owner

    @contextmanager
    def hold(self, owner: Hashable | None) -> Iterator[None]:
        if owner is None:
            yield
            return
        key = f"mobizo:verifying:{owner}"
        count, _ = self._redis.pipeline().incr(key).expire(key, self._ttl_s).execute()
        try:
            if count > self._per_owner:
                raise OwnerBusy(f"{self._per_owner} tasks of this owner are running or waiting")
            yield
        finally:
            self._redis.decr(key)

    def close(self) -> None:
        self._redis.close()


class CeleryVerifyPool:
    """The verify pool's interface (``server.pool.WorkerPool.run``) over the verify queue: ``run`` sends the task
    of ``fn`` (``verify_and_package`` is the one with a task) and waits for its result, raising what the local pool
    would: ``ResultRejected``, ``OwnerBusy`` (``verify_per_user``, counted in Redis for all processes),
    ``WorkTimedOut`` (the wait, queueing included, ran past the timeout: the task is revoked, its process killed)
    or ``WorkerDied`` (the task failed in the worker)."""

    def __init__(self, settings: Settings) -> None:
        self._app = make_celery(settings)
        self._shared = shared_objects(settings.store_url)
        ttl_s = int(settings.verify_timeout_s) + 60
        self._owners = SharedOwnerLimit(str(settings.result_backend), settings.verify_per_user, ttl_s)

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float | None = None,
        key: Hashable | None = None,
        owner: Hashable | None = None,
    ) -> Any:
        if VERIFY_FUNCTIONS.get(fn.__name__) is not fn:
            raise ValueError(f"{fn.__name__} is not a function of the verify queue")
        spool = verify_spool.new_spool() if self._shared is not None else None
        with self._owners.hold(owner):
            try:
                sent, folder = verify_spool.send_args(self._shared, spool, args) if spool else (list(args), None)
                result = self._app.send_task(VERIFY_TASK, args=[fn.__name__, sent, spool], queue=VERIFY_QUEUE)
                reply = wait_result(self._app, result, timeout)
                if "rejected" in reply:
                    raise ResultRejected(*reply["rejected"])
                return verify_spool.receive_result(self._shared, reply["ok"], folder) if spool else reply["ok"]
            finally:
                if spool:
                    self._shared.delete_prefix(spool)

    def owner_full(self, owner: Hashable) -> bool:
        return self._owners.full(owner)

    def close(self) -> None:
        self._app.close()
        self._owners.close()
