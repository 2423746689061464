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
import math
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import httpx
import numpy as np

from device_agent.api import DeviceAPI
from device_agent.backends import Backend, StepRecord, TrainRun
from device_agent.download import ContentCache
from device_agent.eligibility import Eligibility, always
from device_agent.events import Reporter
from device_agent.heartbeat import Heartbeat
from shared.b_file import b_file_bytes, read_b_file
from shared.errors import MobizoError
from shared.files import atomic_write_bytes, private_dir
from shared.retry import Backoff, RetryEvent, RetryPolicy, call_with_retry
from shared.schemas import JobSpec, LeasePublic, RoundReportPublic

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
    eligibility: Eligibility = field(default_factory=always)  # the device's policy (charging, battery, …)
    pause_limit_s: float = 1800.0  # a paused job keeps its lease this long, then gives it back

    @property
    def cache(self) -> ContentCache:
        return ContentCache(self.work_dir / "cache")

    def job_dir(self, work_key: int | str) -> JobDir:
        """The folder of a job (its id) or of a part in a round (``LeasePublic.work_key``)."""
        return JobDir(self.work_dir / "jobs" / str(work_key))

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
    private_seed_file = property(lambda self: self.root / "private_seed")

    def private_seed(self) -> int:
        """A private job's seed of its batches and noise: drawn once on this device, kept here so that a resumed
        run draws the same, never sent (the server could subtract the noise)."""
        if not self.private_seed_file.is_file():
            atomic_write_bytes(self.private_seed_file, str(secrets.randbits(62)).encode())
        return int(self.private_seed_file.read_text())

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
    return f"job-{lease.work_key}-{lease.program.sha256[:16]}"


def fetch_run(ctx: AgentContext, lease: LeasePublic, jobs: JobDir) -> tuple[TrainRun, Path]:
    """Download the job's files (each once, verified) → (the run, the tokenizer file)."""
    policy, cache = ctx.policy(), ctx.cache

    def get(ref, suffix: str) -> Path:
        return cache.fetch(ctx.api.http, ref.url, ref.sha256, suffix, ref.size, policy)

    program, weights, tokenizer = get(lease.program, ".pte"), get(lease.weights, ".ptd"), get(lease.tokenizer, ".json")
    d = lease.manifest.lora_size
    init_b = np.zeros(d, np.float32) if lease.init is None else read_b_file(get(lease.init, ".safetensors"), d)
    spec = lease.spec
    private = None
    if spec.privacy is not None:
        private = private_noise(spec, jobs.private_seed())
    run = TrainRun(
        key=run_key(lease),
        program=program,
        weights=weights,
        manifest=lease.manifest,
        batches=jobs.batches,
        eps=float(np.float32(spec.eps)),
        init_b=init_b,
        checkpoint=jobs.checkpoint,
        checkpoint_every=ctx.checkpoint_every,
        private=private,
    )
    return run, tokenizer


def private_noise(spec: JobSpec, seed: int) -> Callable[[int], tuple[float, np.ndarray]]:
    """A private job's step k -> (clip, the noise of its q g's): the standard deviation the server's noise
    multiplier gives (``shared.privacy.noise_std``), drawn from the device's private seed (stream 1) by NumPy's
    generator (``shared.privacy.Privatizer``): every backend takes these values, and they stay on this device."""
    from shared.privacy import noise_std, step_privatizer

    p = spec.privacy
    clip = float(np.float32(p.clip))
    std = noise_std(p.noise_multiplier, p.clip, spec.batch_size // spec.q)
    return lambda k: (clip, step_privatizer(seed, k, p.clip, std).noise(spec.q))


def prepare_batches(ctx: AgentContext, lease: LeasePublic, tokenizer_file: Path, jobs: JobDir) -> None:
    """Write every step's batch and lr of the job from the device's data (once: a resumed job reuses them, unless
    an older agent wrote them in an older format)."""
    from device_agent.batches import is_current, write_batches

    if jobs.batches.is_file() and is_current(jobs.batches):
        return
    from device_agent.local_data import program_shape, step_batches
    from shared.tokenizer_file import load_tokenizer_file

    spec, shape = lease.spec, program_shape(lease.manifest.config)
    if (spec.batch_size, spec.seq_len, spec.answer_len) != (shape.rows, shape.seq_len, shape.answer_len):
        raise MobizoError(f"job {lease.job_id}: its spec and its program's shape disagree")
    _, examples, held_out = local_examples(ctx, lease)
    tokenizer = load_tokenizer_file(tokenizer_file)
    schedule = (spec.lr, spec.lr_schedule, spec.warmup_steps, spec.lr_floor)
    candidates = lease.manifest.config.candidates
    sample = None
    if spec.privacy is not None:  # uniform samples without replacement, from the device's private seed
        from shared.privacy import step_sample

        if len(examples) < spec.privacy.min_examples:
            raise MobizoError(
                f"job {lease.job_id}: private: this device has {len(examples)} training examples, fewer than the "
                f"{spec.privacy.min_examples} the job's privacy was computed for"
            )
        sample = partial(step_sample, jobs.private_seed(), examples=len(examples), batch_size=spec.batch_size)
    optimizer = lease.manifest.config.optimizer
    steps = step_batches(
        examples, tokenizer, shape, spec.seed, spec.steps, *schedule, candidates, sample, optimizer, spec.bucket
    )
    write_batches(jobs.batches, shape, steps)
    ctx.reporter.event("data", job_id=lease.job_id, examples=len(examples), held_out=len(held_out), steps=spec.steps)


def local_examples(ctx: AgentContext, lease: LeasePublic) -> tuple:
    """(task, training examples, held-out examples) of the job from the device's own data, rendered as the job's
    program frames prompts (chat template or not). The held-out slice is the last records of the file (``text``:
    the user's last texts, all their rows), as ``split_held_out`` counts them."""
    from device_agent.local_data import find_train_file, split_held_out
    from shared.data import load_records_rows
    from shared.tasks import get_task, with_chat

    spec = lease.spec
    task = with_chat(get_task(spec.task_name, spec.template, spec.verbalizer), lease.manifest.config.chat)
    records = load_records_rows(task, find_train_file(ctx.data_dir, spec.task_key, spec.task_name))
    trained, held_out = split_held_out(records, spec.eval_examples)
    return task, [row for rows in trained for row in rows], [row for rows in held_out for row in rows]


def evaluate_held_out(
    ctx: AgentContext,
    lease: LeasePublic,
    run: TrainRun,
    tokenizer_file: Path,
    records: list[dict],
    final_b: np.ndarray,
) -> list[dict]:
    """Accuracy and loss on the held-out slice with the starting B (step 0), every ``eval_every`` steps when the
    job asks, and with the trained B ([] without a slice). Measured with the job's own program by the runtime that
    trained it (``Backend.evaluator``: ExecuTorch's here, or the runner's evaluate mode where the runner runs), all
    points in one call. B at an intermediate step k is rebuilt from the log by replay (``b_at_steps``), so training
    never pauses to evaluate and a resumed job measures the same points."""
    from device_agent.evaluation import evaluate_points
    from device_agent.local_data import program_shape
    from shared.tokenizer_file import load_tokenizer_file

    task, _, held_out = local_examples(ctx, lease)
    if not held_out:
        return []
    tokenizer = load_tokenizer_file(tokenizer_file)
    config, steps = run.manifest.config, lease.spec.steps
    at = eval_steps(steps, lease.spec.eval_every)[:-1]
    points = [*b_at_steps(run.init_b, records, at, config.optimizer), (steps, final_b)]
    evaluator, shape, bs = ctx.backend.evaluator(run), program_shape(config), [b for _, b in points]
    found = evaluate_points(evaluator, bs, held_out, tokenizer, shape, task.kind, config.candidates, config.prior)
    evals = [{"step": step, **figures} for (step, _), figures in zip(points, found, strict=True)]
    for entry in evals:
        ctx.reporter.event("held_out_step", job_id=lease.job_id, **entry)
    ctx.reporter.event("held_out", job_id=lease.job_id, before=evals[0], after=evals[-1])
    return evals


def eval_steps(steps: int, every: int | None) -> list[int]:
    """0, every K steps, and the last step, ascending."""
    return sorted({0, steps, *(range(every, steps, every) if every else ())})


def b_at_steps(
    init_b: np.ndarray, records: list[dict], steps: list[int], optimizer: str = "sgd"
) -> Iterator[tuple[int, np.ndarray]]:
    """(k, B after k steps) for each k of ``steps`` (ascending), replaying the log from ``init_b``: the same
    update the device ran, so B_k is bit for bit the device's (the server's replay check rests on it). NumPy
    (``shared.replay``): no torch on the device."""
    from shared.replay import replay_state

    b, done, state = np.asarray(init_b, dtype=np.float32), 0, None
    for k in steps:
        b, state = replay_state(b, records[done:k], optimizer, state)
        done = k
        yield k, b


def train(
    ctx: AgentContext, lease: LeasePublic, run: TrainRun, jobs: JobDir, beat: Heartbeat, tokenizer_file: Path
) -> str:
    """Train from the last checkpoint; "trained" (result written), or why it stopped early."""
    from device_agent.metrics import training_metrics
    from device_agent.trainlog import LogWriter, read_complete, resume_point
    from shared.train_log import log_record

    ctx.backend.recover(run)
    start, start_b, start_state = resume_point(
        jobs.log, jobs.checkpoint, run.key, run.init_b, run.manifest.config.optimizer
    )
    ctx.reporter.start_training(lease.job_id, lease.spec.steps, start)
    seconds: list[float] = []

    def on_step(record: StepRecord) -> None:
        losses = None if run.private is not None else record.losses  # a private step's losses stay here
        log.write(log_record(record.step, record.seed, record.lr, run.eps, record.g, losses))
        seconds.append(record.seconds)
        loss = float(np.mean(record.losses))  # shown on this device; a private job's heartbeat carries none
        rate = beat.progress(record.step + 1, loss if losses is not None else math.nan)
        ctx.reporter.step(lease.job_id, record.step + 1, loss, rate)

    def should_stop() -> bool:
        return ctx.stop.is_set() or beat.halted or not ctx.eligibility.holds()

    try:
        with LogWriter(jobs.log) as log:
            outcome = ctx.backend.train(run, start, start_b, on_step, should_stop, start_state)
    finally:
        ctx.reporter.end_training()
    if outcome.b is None:
        if beat.halted or ctx.stop.is_set():
            return "cancelled" if beat.cancelled.is_set() else "lost" if beat.lost.is_set() else "stopped"
        return "paused"  # checkpointed after its last step; resumes bit-identically
    log_bytes = jobs.log.read_bytes()
    extra = {
        "seed": lease.spec.seed,
        "lr": lease.spec.lr,
        "lr_schedule": lease.spec.lr_schedule,
        "warmup_steps": lease.spec.warmup_steps,
        "lr_floor": lease.spec.lr_floor,
        "eps": lease.spec.eps,
        "task": lease.spec.task_key,
        "backend": ctx.backend.name,
        "job_id": lease.job_id,
        "log_sha256": hashlib.sha256(log_bytes).hexdigest(),
    }
    records = read_complete(jobs.log)
    if run.private is None:  # a private job's held-out figures are functions of local data: they stay here
        extra["eval"] = evaluate_held_out(ctx, lease, run, tokenizer_file, records, outcome.b)
    metrics = training_metrics(lease.manifest, records, seconds, extra)
    atomic_write_bytes(jobs.b_flat, b_file_bytes(outcome.b))
    atomic_write_bytes(jobs.metrics, json.dumps(metrics, indent=2).encode())
    return "trained"


def upload(ctx: AgentContext, lease: LeasePublic, jobs: JobDir, beat: Heartbeat) -> str:
    """Send the result — B, the log and metrics, or the log and metrics alone (``spec.upload: log``: a round's
    part, or a job submitted so) — retrying until the server takes it (or the agent stops)."""
    log, metrics = jobs.log.read_bytes(), jobs.metrics.read_bytes()
    b_flat = None if lease.spec.upload == "log" else jobs.b_flat.read_bytes()
    sent = {"upload_bytes": len(log) + len(metrics) + len(b_flat or b""), "b_bytes": len(b_flat or b"")}
    try:
        answer = call_with_retry(ctx.policy(), beat.last_call, ctx.api.upload, lease.work_path, b_flat, log, metrics)
    except httpx.HTTPStatusError as error:
        if error.response.status_code != 409:
            raise
        beat.beat()  # a 409 is a cancel, a lost lease or a round that closed: ask which
        return "cancelled" if beat.cancelled.is_set() else "lost"
    if isinstance(answer, RoundReportPublic):
        done = {"round": answer.round, "client_id": answer.client_id}
    else:
        done = {"adapter_id": answer.adapter_id, "version": answer.version}
    ctx.reporter.event("uploaded", job_id=lease.job_id, **done, **sent)
    return "succeeded"


def run_job(ctx: AgentContext, lease: LeasePublic) -> str:
    """Take a leased job as far as it goes; returns its state for this device (``ENDED``, stopped or lost).

    Its folder goes when the job is over for this device; a stopped or lost job keeps it, to resume. A job that
    fails here (no local data for its task, a program that does not load, a result the server refuses) is
    reported to the server, which fails it with the reason.
    """
    jobs = ctx.job_dir(lease.work_key)
    jobs.save_lease(lease)
    fields = lease.event_fields
    ctx.reporter.event("leased", job_id=lease.job_id, attempt=lease.attempt, steps=lease.spec.steps, **fields)
    interval = min(ctx.heartbeat_s, lease.heartbeat_s)
    try:
        with Heartbeat(
            ctx.api, lease.job_id, interval, ctx.reporter.event, jobs.steps_logged(), lease.work_path
        ) as beat:
            state = _run(ctx, lease, jobs, beat)
    except Exception as error:  # noqa: BLE001 - one job's failure (bad data, a runtime error) must not end the daemon
        state = "stopped" if ctx.stop.is_set() else "failed"
        if state == "failed":
            report_failure(ctx, lease.job_id, f"{type(error).__name__}: {error}", lease.work_path)
    if state in ENDED or (state == "released" and not lease.resumable):
        jobs.remove()
    ctx.reporter.event("job_" + state, job_id=lease.job_id)
    return state


def report_failure(ctx: AgentContext, job_id: int, error: str, path: str | None = None) -> None:
    """Tell the server this device gives up on the job, or on its part in a round (``path``: the lease's
    ``work_path``); retried while the server is down; a refusal is moot."""
    ctx.reporter.event("error", job_id=job_id, error=error)
    try:
        call_with_retry(ctx.policy(), ctx.api.fail, path or job_id, error)
    except httpx.HTTPError as refused:  # the job was cancelled or its lease lost meanwhile: nothing to report
        ctx.reporter.event("failure_not_reported", job_id=job_id, reason=str(refused))


def pause(ctx: AgentContext, lease: LeasePublic, beat: Heartbeat) -> str:
    """Wait, heartbeating as ``paused``, until the policy holds again ("resume"), or the limit passes ("released":
    work the device may not come back to, a round part, is given back to the server; a job's lease is left to
    expire: ``LeasePublic.resumable``), or the job or the agent ends."""
    ctx.reporter.event("paused", job_id=lease.job_id, reason=ctx.eligibility.reason())
    beat.paused = True
    deadline = time.monotonic() + ctx.pause_limit_s
    try:
        while not (ctx.stop.is_set() or beat.halted):
            if ctx.eligibility.holds():
                ctx.reporter.event("resumed", job_id=lease.job_id)
                return "resume"
            if time.monotonic() >= deadline:
                ctx.reporter.event("released", job_id=lease.job_id, paused_s=ctx.pause_limit_s)
                if not lease.resumable:
                    report_failure(ctx, lease.job_id, "paused past the device's limit", lease.work_path)
                return "released"
            ctx.stop.wait(min(ctx.eligibility.check_s, 1.0))
    finally:
        beat.paused = False
    return "cancelled" if beat.cancelled.is_set() else "lost" if beat.lost.is_set() else "stopped"


def _run(ctx: AgentContext, lease: LeasePublic, jobs: JobDir, beat: Heartbeat) -> str:
    run, tokenizer_file = fetch_run(ctx, lease, jobs)
    state = "trained" if jobs.trained() else "preparing"
    while state == "preparing":
        prepare_batches(ctx, lease, tokenizer_file, jobs)
        state = train(ctx, lease, run, jobs, beat, tokenizer_file)
        if state == "paused":
            after = pause(ctx, lease, beat)
            state = "preparing" if after == "resume" else after
    if state == "trained":
        state = upload(ctx, lease, jobs, beat)
    if state in ENDED:
        ctx.backend.forget(run)
    return state
