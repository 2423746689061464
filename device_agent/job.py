"""One leased job on the device: fetch its files, build its batches from local data, train with heartbeats,
upload B, the log and metrics.

A job's state lives in ``WORK/jobs/<job id>/`` so that a killed or stopped agent picks it up where it was:
``lease.json`` (the lease, to resume without asking again), ``batches.mzb`` (every step's data, fixed once),
``train_log.jsonl`` and ``checkpoint.ckpt`` (progress; see ``device_agent.trainlog``), and once training is done
``b_flat.safetensors`` and ``metrics.json`` (the result, waiting for its upload). The folder is deleted when the
job ends for this device (uploaded, cancelled, or gone). Downloads live in ``WORK/cache/`` by sha256, so a model's
weights are fetched once for all its jobs.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from device_agent.api import DeviceAPI
from device_agent.backends import Backend, StepRecord, TrainRun
from device_agent.download import ContentCache
from device_agent.events import Reporter
from device_agent.heartbeat import Heartbeat
from shared.b_file import b_file_bytes, read_b_file
from shared.errors import MobizoError
from shared.files import atomic_write_bytes, private_dir
from shared.retry import Backoff, RetryEvent, RetryPolicy, call_with_retry
from shared.schemas import LeasePublic

# What became of a job: it is over for this device (succeeded, cancelled, failed), or it may come back (stopped:
# this agent is shutting down; lost: the lease went, the job may be leased again).
ENDED = ("succeeded", "cancelled", "failed")


@dataclass
class AgentContext:
    """What every job of one agent shares."""

    api: DeviceAPI
    backend: Backend
    work_dir: Path
    data_dir: Path
    reporter: Reporter
    stop: threading.Event = field(default_factory=threading.Event)
    checkpoint_every: int = 50
    heartbeat_s: float = 5.0  # at most this long between heartbeats (sooner if the lease asks)
    backoff: Backoff = field(default_factory=Backoff)

    @property
    def cache(self) -> ContentCache:
        return ContentCache(self.work_dir / "cache")

    def job_dir(self, job_id: int) -> JobDir:
        return JobDir(self.work_dir / "jobs" / str(job_id))

    def policy(self) -> RetryPolicy:
        return retry_policy(self.stop, self.backoff, self.reporter)


def retry_policy(stop: threading.Event, backoff: Backoff, reporter: Reporter) -> RetryPolicy:
    """Retry transient failures until they stop or the agent does; waits end early on shutdown."""

    def on_retry(event: RetryEvent) -> None:
        reporter.event("retry", attempt=event.attempt, wait_s=round(event.delay, 2), error=str(event.error))

    return RetryPolicy(backoff=backoff, on_retry=on_retry, sleep=stop.wait, stopped=stop.is_set)


@dataclass(frozen=True)
class JobDir:
    root: Path

    lease = property(lambda self: self.root / "lease.json")
    batches = property(lambda self: self.root / "batches.mzb")
    log = property(lambda self: self.root / "train_log.jsonl")
    checkpoint = property(lambda self: self.root / "checkpoint.ckpt")
    b_flat = property(lambda self: self.root / "b_flat.safetensors")
    metrics = property(lambda self: self.root / "metrics.json")

    def trained(self) -> bool:
        return self.metrics.is_file()  # written last, after B

    def steps_logged(self) -> int:
        from device_agent.trainlog import read_complete

        return len(read_complete(self.log))

    def save_lease(self, lease: LeasePublic) -> None:
        private_dir(self.root)  # the job's tokenized data, log and checkpoint: 0700, files 0600
        atomic_write_bytes(self.lease, lease.model_dump_json().encode())

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def run_key(lease: LeasePublic) -> str:
    """A run's identity in checkpoints (shell-safe: the adb backend passes it on a command line)."""
    return f"job-{lease.job_id}-{lease.program.sha256[:16]}"


def fetch_run(ctx: AgentContext, lease: LeasePublic, jobs: JobDir) -> tuple[TrainRun, Path]:
    """Download the job's files (each once, verified) → (the run, the tokenizer file)."""
    policy, cache = ctx.policy(), ctx.cache

    def get(ref, suffix: str) -> Path:
        return cache.fetch(ctx.api.http, ref.url, ref.sha256, suffix, ref.size, policy)

    program, weights, tokenizer = get(lease.program, ".pte"), get(lease.weights, ".ptd"), get(lease.tokenizer, ".json")
    init_b = None if lease.init is None else read_b_file(get(lease.init, ".safetensors"), lease.manifest.lora_size)
    spec = lease.spec
    run = TrainRun(
        key=run_key(lease),
        program=program,
        weights=weights,
        manifest=lease.manifest,
        batches=jobs.batches,
        lr=float(np.float32(spec.lr)),
        eps=float(np.float32(spec.eps)),
        init_b=init_b,
        checkpoint=jobs.checkpoint,
        checkpoint_every=ctx.checkpoint_every,
    )
    return run, tokenizer


def initial_b(run: TrainRun) -> np.ndarray | None:
    """B before step 0: the job's starting adapter, else the zeros a server-compiled program starts from (None for a
    program exported with its own starting B, which only the program knows)."""
    if run.init_b is not None:
        return run.init_b
    return None if run.manifest.init_b else np.zeros(run.manifest.lora_size, np.float32)


def prepare_batches(ctx: AgentContext, lease: LeasePublic, tokenizer_file: Path, jobs: JobDir) -> None:
    """Write every step's batch of the job from the device's data (once: a resumed job reuses them)."""
    if jobs.batches.is_file():
        return
    from device_agent.batches import write_batches
    from device_agent.local_data import find_train_file, program_shape, step_batches
    from shared.data import load_examples
    from shared.tasks import get_task
    from shared.tokenizer_file import load_tokenizer_file

    spec, shape = lease.spec, program_shape(lease.manifest.config)
    if (spec.batch_size, spec.seq_len, spec.answer_len) != (shape.rows, shape.seq_len, shape.answer_len):
        raise MobizoError(f"job {lease.job_id}: its spec and its program's shape disagree")
    task = get_task(spec.task_name, spec.template, spec.verbalizer)
    examples = load_examples(task, find_train_file(ctx.data_dir, spec.task_key, spec.task_name))
    tokenizer = load_tokenizer_file(tokenizer_file)
    write_batches(jobs.batches, shape, step_batches(examples, tokenizer, shape, spec.seed, spec.steps))
    ctx.reporter.event("data", job_id=lease.job_id, examples=len(examples), steps=spec.steps)


def train(ctx: AgentContext, lease: LeasePublic, run: TrainRun, jobs: JobDir, beat: Heartbeat) -> str:
    """Train from the last checkpoint; "trained" (result written), or why it stopped early."""
    from device_agent.metrics import training_metrics
    from device_agent.trainlog import LogWriter, read_complete, resume_point
    from shared.train_log import log_record

    ctx.backend.recover(run)
    start, start_b = resume_point(jobs.log, jobs.checkpoint, run.key, initial_b(run))
    ctx.reporter.start_training(lease.job_id, lease.spec.steps, start)
    seconds: list[float] = []

    def on_step(record: StepRecord) -> None:
        entry = log_record(record.step, record.seed, run.lr, run.eps, record.g, record.losses)
        log.write(entry)
        seconds.append(record.seconds)
        loss = sum(entry["losses"]) / len(entry["losses"])
        ctx.reporter.step(lease.job_id, record.step + 1, loss, beat.progress(record.step + 1, loss))

    try:
        with LogWriter(jobs.log) as log:
            outcome = ctx.backend.train(run, start, start_b, on_step, lambda: ctx.stop.is_set() or beat.halted)
    finally:
        ctx.reporter.end_training()
    if outcome.b is None:
        return "cancelled" if beat.cancelled.is_set() else "lost" if beat.lost.is_set() else "stopped"
    log_bytes = jobs.log.read_bytes()
    extra = {
        "seed": lease.spec.seed,
        "lr": lease.spec.lr,
        "eps": lease.spec.eps,
        "task": lease.spec.task_key,
        "backend": ctx.backend.name,
        "job_id": lease.job_id,
        "log_sha256": hashlib.sha256(log_bytes).hexdigest(),
    }
    metrics = training_metrics(lease.manifest, read_complete(jobs.log), seconds, extra)
    atomic_write_bytes(jobs.b_flat, b_file_bytes(outcome.b))
    atomic_write_bytes(jobs.metrics, json.dumps(metrics, indent=2).encode())
    return "trained"


def upload(ctx: AgentContext, lease: LeasePublic, jobs: JobDir, beat: Heartbeat) -> str:
    """Send the result, retrying until the server takes it (or the agent stops)."""
    parts = (jobs.b_flat.read_bytes(), jobs.log.read_bytes(), jobs.metrics.read_bytes())
    try:
        result = call_with_retry(ctx.policy(), ctx.api.upload, lease.job_id, *parts)
    except httpx.HTTPStatusError as error:
        if error.response.status_code != 409:
            raise
        beat.beat()  # a 409 is a cancel or a lost lease: ask which
        return "cancelled" if beat.cancelled.is_set() else "lost"
    ctx.reporter.event("uploaded", job_id=lease.job_id, adapter_id=result.adapter_id, version=result.version)
    return "succeeded"


def run_job(ctx: AgentContext, lease: LeasePublic) -> str:
    """Take a leased job as far as it goes; returns its state for this device (``ENDED``, stopped or lost).

    Its folder goes when the job is over for this device; a stopped or lost job keeps it, to resume. A job that
    fails here (no local data for its task, a program that does not load, a result the server refuses) is
    reported to the server, which fails it with the reason.
    """
    jobs = ctx.job_dir(lease.job_id)
    jobs.save_lease(lease)
    ctx.reporter.event("leased", job_id=lease.job_id, attempt=lease.attempt, steps=lease.spec.steps)
    try:
        with Heartbeat(
            ctx.api, lease.job_id, min(ctx.heartbeat_s, lease.heartbeat_s), ctx.reporter.event, jobs.steps_logged()
        ) as beat:
            state = _run(ctx, lease, jobs, beat)
    except Exception as error:  # noqa: BLE001 - one job's failure (bad data, a runtime error) must not end the daemon
        state = "stopped" if ctx.stop.is_set() else "failed"
        if state == "failed":
            report_failure(ctx, lease.job_id, f"{type(error).__name__}: {error}")
    if state in ENDED:
        jobs.remove()
    ctx.reporter.event("job_" + state, job_id=lease.job_id)
    return state


def report_failure(ctx: AgentContext, job_id: int, error: str) -> None:
    """Tell the server this device gives up on the job (retried while the server is down; a refusal is moot)."""
    ctx.reporter.event("error", job_id=job_id, error=error)
    try:
        call_with_retry(ctx.policy(), ctx.api.fail, job_id, error)
    except httpx.HTTPError as refused:  # the job was cancelled or its lease lost meanwhile: nothing to report
        ctx.reporter.event("failure_not_reported", job_id=job_id, reason=str(refused))


def _run(ctx: AgentContext, lease: LeasePublic, jobs: JobDir, beat: Heartbeat) -> str:
    run, tokenizer_file = fetch_run(ctx, lease, jobs)
    state = "trained" if jobs.trained() else "preparing"
    if state == "preparing":
        prepare_batches(ctx, lease, tokenizer_file, jobs)
        state = train(ctx, lease, run, jobs, beat)
    if state == "trained":
        state = upload(ctx, lease, jobs, beat)
    if state in ENDED:
        ctx.backend.forget(run)
    return state
