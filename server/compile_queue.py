"""The compile queue: the one queue of every export, outside any request. Jobs go in by id and their training
programs come out; inference programs go in by key (``build_inference``, for ``server.inference_builds``), and so do
merged downloads (``build_merged``, for ``server.merged_builds``: they load a base model too).

``CompileQueue`` is the whole interface the server sees, so a distributed queue replaces ``LocalCompileQueue``
without touching it: ``server.celery_queue.CeleryCompileQueue`` (``MOBIZO_QUEUE=celery``), whose workers then run
both kinds of export. Both run one job the same way (``compile_job``): move it to ``compiling``, export the program
(``server.compile.build_program``), record ``ready`` or ``failed`` with the error text. The local queue runs one
driver thread per worker process of its own, so a job is ``compiling`` exactly while a process works on it; an
inference build or a merge waits until no job is waiting to compile or compiling, then for a free process of the
same pool: devices asking for inference programs and users asking for merges never keep a job from compiling (at most
the builds already running).
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from sqlalchemy.orm import Session, sessionmaker

from server import metrics
from server.compile import build_inference, build_program
from server.merged import merge_archive
from server.pool import WorkerPool
from server.state import jobs
from server.state.jobs import CompileInput
from server.store import ArtifactStore

log = logging.getLogger(__name__)
BuildFn = Callable[[str, str, dict[str, Any], str, str], dict[str, Any]]


def _log_crash(future: Future) -> None:
    """A driver that died (database unreachable, say) leaves its job for ``recover``; say so in the log."""
    if not future.cancelled() and future.exception() is not None:
        log.error("compile driver failed", exc_info=future.exception())


def export_inference(
    store: ArtifactStore, run: Callable[..., Any], model_dir: str, model_sha256: str, config: dict[str, Any], key: str
) -> dict[str, Any]:
    """One inference build, whoever runs it: ``run`` (a worker pool's ``run``, or a call in this process) exports
    the program into the store's folders (``build_inference``), then it is published → its manifest (JSON)."""
    programs, blobs = str(store.programs_dir), str(store.blobs_dir)
    manifest = run(build_inference, model_dir, model_sha256, config, programs, blobs, key=key)
    store.publish_program(key, manifest)
    return manifest


def export_merged(
    store: ArtifactStore, run: Callable[..., Any], model_dir: str, archive_sha256: str, dtype: str, key: str
) -> dict[str, Any]:
    """One merge, whoever runs it: ``run`` (a worker pool's ``run``, or a call in this process) folds the PEFT archive
    into its base (``server.merged.merge_archive``) under ``tmp/``, then the zip is kept as ``merged/<key>.zip``
    (``ArtifactStore.keep_merged``) → its ``sha256`` and ``size``."""
    tmp = store.tmp_dir()
    try:
        run(merge_archive, model_dir, str(store.archive(archive_sha256)), dtype, str(tmp / "merged.zip"))
        return store.keep_merged(tmp / "merged.zip", key)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def compile_job(
    sessions: sessionmaker[Session],
    job_id: int,
    export: Callable[[CompileInput], dict[str, Any]],
    resume: bool = False,
    abandoned: Callable[[], bool] = lambda: False,
) -> None:
    """Run one job's compilation: queued → compiling, ``export`` it, → ready (or failed with the export's error).

    ``resume`` takes over a job left ``compiling`` (``state.jobs.start_compiling``). ``abandoned()`` is asked when
    the export raised: True means the queue itself is stopping, and the job stays ``compiling`` for recovery.
    """
    with sessions() as session:
        work = jobs.start_compiling(session, job_id, resume=resume)
    if work is None:
        return
    start = time.perf_counter()
    try:
        built = export(work)
    except Exception as exc:  # any failure of the export is the job's error text
        metrics.EXPORT_SECONDS.labels("failed").observe(time.perf_counter() - start)
        if abandoned():
            return
        log.warning("job %d: compile failed: %s", job_id, exc)
        with sessions() as session:
            jobs.fail(session, job_id, f"compile failed: {type(exc).__name__}: {exc}", ("compiling",))
        return
    metrics.EXPORT_SECONDS.labels("built").observe(time.perf_counter() - start)
    with sessions() as session:
        jobs.finish_compiling(session, job_id, built)


class CompileQueue(Protocol):
    def submit(self, job_id: int) -> None:
        """Compile the job's program eventually; the job is ``queued`` when this is called."""

    def cancel(self, job_id: int) -> None:
        """Stop the job's compilation if one is running; the job is already ``cancelled`` when this is called."""

    def recover(self) -> int:
        """On start: take back jobs a previous run left queued or compiling; returns how many."""

    def build_inference(self, model_dir: str, model_sha256: str, config: dict[str, Any], key: str) -> dict[str, Any]:
        """Export the inference program ``key`` (``server.compile.build_inference``) and publish it to the store;
        waits for it → its manifest (JSON). Raises the export's error."""

    def build_merged(self, model_dir: str, archive_sha256: str, dtype: str, key: str) -> dict[str, Any]:
        """Fold an adapter's PEFT archive into its base (``export_merged``) and keep it in the store as the merged
        download ``key``; waits for it → its ``sha256`` and ``size``. Raises the merge's error."""

    def close(self) -> None:
        """Stop taking work; running compilations may be abandoned (``recover`` picks them up on restart)."""


class LocalCompileQueue:
    """In-process queue: driver threads feeding a pool of ``workers`` compile processes."""

    def __init__(
        self, sessions: sessionmaker[Session], store: ArtifactStore, workers: int, build: BuildFn = build_program
    ) -> None:
        self._sessions = sessions
        self._store = store
        self._build = build
        self._pool = WorkerPool(workers)
        self._drivers = ThreadPoolExecutor(workers, thread_name_prefix="compile")
        self._closing = False
        self._jobs = 0  # jobs submitted and not yet compiled: inference builds wait while there are any
        self._jobs_done = threading.Condition()

    def submit(self, job_id: int) -> None:
        with self._jobs_done:
            self._jobs += 1
        self._drivers.submit(self._compile_counted, job_id).add_done_callback(_log_crash)

    def _compile_counted(self, job_id: int) -> None:
        try:
            self._compile(job_id)
        finally:
            with self._jobs_done:
                self._jobs -= 1
                self._jobs_done.notify_all()

    def cancel(self, job_id: int) -> None:
        """Kill the worker exporting the job's program; its driver then finds the job cancelled and moves on."""
        self._pool.cancel(job_id)

    def recover(self) -> int:
        """Jobs a previous run left queued or compiling go (back) into the queue."""
        with self._sessions() as session:
            ids = jobs.requeue_unfinished(session)
        for job_id in ids:
            self.submit(job_id)
        return len(ids)

    def _compile(self, job_id: int) -> None:
        """Export in a pool worker; a failure while closing leaves the job compiling for ``recover`` on restart."""

        def export(work: CompileInput) -> dict[str, Any]:
            programs, blobs = str(self._store.programs_dir), str(self._store.blobs_dir)
            built = self._pool.run(
                self._build, work.model_dir, work.model_sha256, work.spec, programs, blobs, key=job_id
            )
            self._store.publish_program(built["key"], built["manifest"])
            return built

        compile_job(self._sessions, job_id, export, abandoned=lambda: self._closing)

    def build_inference(self, model_dir: str, model_sha256: str, config: dict[str, Any], key: str) -> dict[str, Any]:
        """Behind every job: waits until none is queued or compiling here, then for a free worker."""
        with self._jobs_done:
            self._jobs_done.wait_for(lambda: self._jobs == 0 or self._closing)
        return export_inference(self._store, self._pool.run, model_dir, model_sha256, config, key)

    def build_merged(self, model_dir: str, archive_sha256: str, dtype: str, key: str) -> dict[str, Any]:
        """Behind every job, as an inference build: waits until none is queued or compiling, then for a worker."""
        with self._jobs_done:
            self._jobs_done.wait_for(lambda: self._jobs == 0 or self._closing)
        return export_merged(self._store, self._pool.run, model_dir, archive_sha256, dtype, key)

    def close(self) -> None:
        """Stop the drivers and kill the compile workers; jobs they were compiling are left for ``recover``."""
        self._closing = True
        with self._jobs_done:
            self._jobs_done.notify_all()
        self._drivers.shutdown(wait=False, cancel_futures=True)
        self._pool.close()


class PausedCompileQueue:
    """``MOBIZO_COMPILE_PAUSED``: jobs are accepted and stay ``queued``; a server started without it compiles them
    (``recover``). For fuzzing the API without an export per job, and for maintenance."""

    def submit(self, job_id: int) -> None:
        log.info("job %d: compile queue paused, the job stays queued", job_id)

    def cancel(self, job_id: int) -> None:
        """Nothing runs while paused: the job's state alone says it is cancelled."""

    def recover(self) -> int:
        return 0

    def build_inference(self, model_dir: str, model_sha256: str, config: dict[str, Any], key: str) -> dict[str, Any]:
        raise RuntimeError("the compile queue is paused (MOBIZO_COMPILE_PAUSED)")

    def build_merged(self, model_dir: str, archive_sha256: str, dtype: str, key: str) -> dict[str, Any]:
        raise RuntimeError("the compile queue is paused (MOBIZO_COMPILE_PAUSED)")

    def close(self) -> None:
        pass
