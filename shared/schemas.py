"""Pydantic request/response models of the REST API (``/v1``), shared by the server and the device agent.

One module so that both sides validate the same shapes: the server declares them on its routes (and so in
OpenAPI), the agent parses the server's answers with them. Only pydantic and the standard library are imported.

Naming follows the usual FastAPI layout: ``XCreate`` is what a client sends, ``XPublic`` what the server answers,
``XsPublic`` a list (``data`` + ``count``).

Result upload (``POST /v1/work/{work}/result``) is ``multipart/form-data`` with three file parts named by
``RESULT_PARTS``: ``b_flat`` (a B file, ``shared.b_file``: safetensors holding exactly one float32 tensor
``"b_flat"`` of shape [D], the program's ``get_lora_b()``), ``log`` (the training log, JSON Lines,
``shared.train_log``) and ``metrics`` (``metrics.json``). A device downloads every file by content
(``GET /v1/blobs/{sha256}``, ``blob_url``); a starting B is a B file too.
"""

from __future__ import annotations

import hashlib
import json
import math
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, field_validator, model_validator

from shared import defaults
from shared.backends import (
    PROBE_WEIGHTS_HELP,
    DeviceBackend,
    Objective,
    Optimizer,
    Parallel,
    ProbeWeights,
    ProgramBackend,
    Quantization,
)
from shared.cpuinfo import CPU_FEATURES, CpuArch, CpuFeature
from shared.errors import FieldError, UsageError
from shared.manifest import InferenceConfig, InferenceManifest, ProgramManifest, check_prompt_room, examples_per_query
from shared.schedule import Schedule, check_schedule
from shared.text_fields import Line, Report, Text

RESULT_PARTS = ("b_flat", "log", "metrics")

JobStatus = Literal["queued", "compiling", "ready", "running", "succeeded", "failed", "cancelled"]
Aggregation = Literal["fedavg", "trimmed-mean", "median"]
UploadMode = Literal["full", "log"]
TERMINAL_STATUSES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})
Method = Literal["mobizo"]

_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
_MAX_SEED = 2**31 - 1
MAX_DB_INT = 2**31 - 1  # the largest value of an INTEGER column (PostgreSQL): ids, memory_mb, steps
_MAX_INT64 = 2**63 - 1
MAX_LOSS = 1e4  # a mean cross-entropy in nats: every loss a device reports (log, metrics, heartbeat) lies in [0, it]
MAX_EVALS = 1000  # held-out measurements of one job (eval_every): each costs a pass over the slice on the device
MAX_LABELS = 256  # a verbalizer's labels: each is scored on every evaluation example
MAX_MODEL_PATH = 1024  # with the names of the files inside it, well under the system's PATH_MAX (4096)


class _Strict(BaseModel):
    """Requests reject unknown fields so that a typo answers 422 instead of being silently ignored."""

    model_config = ConfigDict(extra="forbid")


# --- users, models, enrollment, devices -------------------------------------------------------------------------


class UserCreate(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=_NAME)


class UserCreated(BaseModel):
    """The API key is shown once; the server keeps only its hash."""

    id: int
    name: str
    api_key: str


class ModelCreate(_Strict):
    name: str = Field(min_length=1, max_length=128, pattern=_NAME)
    path: Line = Field(
        min_length=1,
        max_length=MAX_MODEL_PATH,
        description=f"a Hugging Face model directory on the server, an absolute path (or ~/...; at most "
        f"{MAX_MODEL_PATH} characters)",
    )

    @field_validator("path")
    @classmethod
    def _absolute(cls, path: str) -> str:
        """A relative path would name a directory by the server process's working directory, which no client sees."""
        if not Path(path).expanduser().is_absolute():
            raise ValueError("must be an absolute path (the directory as the server sees it)")
        return path


class ModelPublic(BaseModel):
    id: int
    name: str
    sha256: str = Field(description="content hash of the model's files (config, weights, tokenizer)")
    architecture: str
    modules: list[str] = Field(description="names of the linear layers a job may target (e.g. q_proj)")
    created_at: datetime


class ModelsPublic(BaseModel):
    data: list[ModelPublic]
    count: int


class EnrollmentCodeCreate(_Strict):
    ttl_s: int = Field(default=900, ge=60, le=7 * 24 * 3600, description="seconds until the code expires")


class EnrollmentCodePublic(BaseModel):
    code: str
    expires_at: datetime


class CpuReport(_Strict):
    """A device's CPU as it reports it (``shared.cpuinfo``): its architecture and the instruction-set features that
    decide which kernels its programs run."""

    arch: CpuArch
    features: list[CpuFeature] = Field(default_factory=list, max_length=len(CPU_FEATURES))

    @field_validator("features")
    @classmethod
    def _in_order(cls, features: list[str]) -> list[str]:
        return [f for f in CPU_FEATURES if f in features]  # each once, in the vocabulary's order


class DeviceCreate(_Strict):
    code: Line = Field(min_length=1, max_length=64, description="a one-time enrollment code")
    name: Line = Field(min_length=1, max_length=128)
    platform: Line = Field(default="", max_length=128)
    backend: DeviceBackend = "executorch"
    memory_mb: int | None = Field(default=None, ge=0, le=MAX_DB_INT)
    cpu: CpuReport | None = Field(default=None, description="the device's CPU where it trains")


class DeviceEnrolled(BaseModel):
    """The device token is shown once; the server keeps only its hash."""

    device_id: int
    token: str


class DevicePublic(BaseModel):
    id: int
    name: str
    platform: str
    backend: DeviceBackend
    memory_mb: int | None
    cpu: CpuReport | None = None
    created_at: datetime
    last_seen_at: datetime | None
    revoked_at: datetime | None = None


class DevicesPublic(BaseModel):
    data: list[DevicePublic]
    count: int


# --- jobs ----------------------------------------------------------------------------------------------------------


class TaskSpec(BaseModel):
    """A built-in task by name, or a custom one as template + verbalizer (``task`` then ``"custom"`` or omitted).

    Checked by ``shared.tasks.get_task``, the one home of what a well-formed task is.
    """

    task: Line | None = Field(default=None, min_length=1, max_length=64, description="a task name (sst2, rte, lm, …)")
    template: Text | None = Field(default=None, min_length=1, max_length=4096, examples=["{text} It was"])
    verbalizer: dict[Annotated[Line, Field(max_length=64)], Annotated[Text, Field(max_length=256)]] | None = Field(
        default=None,
        max_length=MAX_LABELS,
        examples=[{"0": " terrible", "1": " great"}],
        description=f"label → answer text; at most {MAX_LABELS} labels",
    )
    chat_template: StrictBool = Field(
        default=False, description="frame each prompt with the model's chat template (instruct models)"
    )
    calibrate: StrictBool = Field(
        default=False,
        description="classification: divide the prompt's content-free prior (measured on the base model when the "
        "program is compiled) out of the answers' scores, in the training loss and the held-out accuracy",
    )
    prompt: Literal["model", "builtin"] = Field(
        default="model",
        description="a built-in task without a template: model, the prompt chosen for the model (the model "
        "folder's mobizo_prompts.json, written by `mobizo prompts search --write-model`) where it has one, else the "
        "task's own; builtin, the task's own",
    )
    eval_examples: int = Field(
        default=defaults.EVAL_EXAMPLES,
        ge=0,
        le=10_000,
        description="examples of the device's own data (a text task's texts) kept out of training, the last ones "
        "of its file (at most a fifth of them), to measure accuracy and loss before and after; 0: none",
    )

    @model_validator(mode="after")
    def _known_task(self) -> TaskSpec:
        from shared.tasks import get_task

        if self.task is None and self.template is None and self.verbalizer is None:
            raise FieldError("task", "give a task name, or a template and a verbalizer")
        try:
            get_task(self.task_name, self.template, self.verbalizer)
        except UsageError as exc:
            raise FieldError(exc.field, exc.reason) from None
        return self

    def task_kind(self) -> str | None:
        """The task's kind (``shared.tasks.Kind``), None while the task is not a valid one (its own check says why)."""
        from shared.tasks import get_task

        try:
            return get_task(self.task_name, self.template, self.verbalizer).kind
        except UsageError:
            return None

    @property
    def task_name(self) -> str:
        """The ``shared.tasks`` name: ``custom`` when only a template and a verbalizer are given."""
        return self.task if self.task is not None else "custom"

    @property
    def task_key(self) -> str:
        """The adapter registry's task: the name, or ``<name>-<hash>`` with a template (``custom-<hash>``; a built-in
        task read through another prompt, ``sst2-<hash>``) so that different prompts never mix."""
        if self.template is None:
            return self.task_name
        blob = json.dumps([self.template, self.verbalizer], sort_keys=True).encode()
        return f"{self.task_name}-{hashlib.sha256(blob).hexdigest()[:12]}"


class Privacy(_Strict):
    """A private job (DP-ZO, ``shared.privacy``, docs/guide/privacy.md): (epsilon, delta)-differential privacy for
    each of the device's examples over the job's steps. The device clips each example's projected difference to
    [-clip, clip], noises g, samples its batches without replacement from at least ``min_examples`` examples, and
    uploads g alone (no losses)."""

    epsilon: float = Field(gt=0, le=100, allow_inf_nan=False, description="the privacy target over the whole job")
    delta: float = Field(default=defaults.DP_DELTA, gt=0, le=1e-3, allow_inf_nan=False)
    clip: float = Field(default=defaults.DP_CLIP, gt=0, le=1000, allow_inf_nan=False, description="C, per example")
    min_examples: int = Field(
        ge=2,
        le=MAX_DB_INT,
        description="a lower bound on the device's training examples, stated by the user (the server never sees "
        "the data): the accountant counts batch/min_examples as the sampling rate; a device with fewer refuses",
    )
    noise_multiplier: float | None = Field(
        default=None, gt=0, description="sigma for (epsilon, delta), set by the server at submit (not to be sent)"
    )


class PrivacyBudget(_Strict):
    """What a user's private jobs may spend together: epsilon at delta, composed over all of them."""

    epsilon: float = Field(gt=0, le=1000, allow_inf_nan=False)
    delta: float = Field(default=defaults.DP_DELTA, gt=0, le=1e-3, allow_inf_nan=False)


class PrivacyEntry(BaseModel):
    """One private job in the ledger, or one part of a private federated job the user's device took (``round``
    set): what it asked for and the noise it got; ``spends``: whether it counts (it may have touched data: every job
    but one that ended before any device leased it; every part)."""

    job_id: int
    status: str
    steps: int
    batch_size: int
    privacy: Privacy
    spends: bool
    round: int | None = Field(
        default=None, description="a private federated job's round whose part the user's device took (status: its)"
    )


class PrivacyLedgerPublic(BaseModel):
    """A user's privacy ledger (``GET /v1/privacy``): the budget, epsilon spent by the jobs that count (composed
    by one accountant at the budget's delta), what remains, and the jobs."""

    budget: PrivacyBudget
    spent: float
    remaining: float
    jobs: list[PrivacyEntry]


class HyperParams(BaseModel):
    """The method's hyperparameters (defaults: ``shared.defaults``); ``batch_size`` is the total per step, split
    into q groups of E."""

    method: Method = defaults.METHOD
    q: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description=f"queries per step; default: {defaults.Q} for mobizo (the benchmark's best at batch "
        f"{defaults.BATCH_SIZE}), 1 for the other methods",
    )
    batch_size: int = Field(default=defaults.BATCH_SIZE, ge=1, le=1024)
    bucket: int = Field(
        default=defaults.BUCKET,
        ge=1,
        le=64,
        description="batches per length bucket: each window of that many batches is sorted by length, so a batch "
        "pads little (shared.data.batch_indices); 1: batches as drawn; a private job draws its own",
    )
    steps: int | None = Field(default=None, ge=1, le=1_000_000, description="default: the method's")
    eval_every: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description="also measure the device's held-out slice every K steps (a curve in the adapter's held_out); "
        f"at most {MAX_EVALS} points; default: before and after only",
    )
    lr: float | None = Field(
        default=None, gt=0, le=1, description="the base learning rate (peak of the schedule); default: the method's"
    )
    lr_schedule: Schedule | None = Field(
        default=None,
        description="lr over the steps after warm-up: constant, linear or cosine decay from lr to lr_floor*lr "
        "(shared.schedule.lr_at); a federated job's schedule restarts in every round (each part is a run of steps); "
        "default: the objective's",
    )
    warmup_steps: int = Field(
        default=defaults.WARMUP_STEPS,
        ge=0,
        le=1_000_000,
        description="the first W steps raise lr linearly to its base, lr*(k+1)/W at step k; less than steps",
    )
    lr_floor: float = Field(
        default=defaults.LR_FLOOR, ge=0, le=1, description="where linear and cosine decay end, as a fraction of lr"
    )
    eps: float | None = Field(default=None, gt=0, le=1, description="default: the method's")
    rank: int | None = Field(default=None, ge=1, le=256, description="LoRA rank; default: the objective's")
    alpha: float | None = Field(
        default=None,
        gt=0,
        le=4096,
        description=f"LoRA alpha (scaling alpha/rank); default: {defaults.SCALING:g} x rank",
    )
    targets: list[Line] = Field(default=list(defaults.TARGETS), min_length=1, max_length=16)
    seq_len: int = Field(default=defaults.SEQ_LEN, ge=8, le=4096)
    seed: int = Field(default=defaults.SEED, ge=0, le=_MAX_SEED)
    a_seed: int = Field(default=defaults.A_SEED, ge=0, le=_MAX_SEED, description="seed of the frozen LoRA A matrices")
    program_backend: ProgramBackend = defaults.PROGRAM_BACKEND
    quantize: Quantization = Field(default=defaults.QUANTIZE, description="the program's frozen base linears")
    parallel: Parallel = Field(
        default=defaults.PARALLEL,
        description="how a mobizo step runs its 2q paths: both (one pass), outer (queries side by side, ± in turn), "
        "inner (± side by side, queries in turn) or none (one path at a time, the MeZO way); the same losses and B",
    )
    group_size: int = Field(default=defaults.GROUP_SIZE, ge=32, le=4096, multiple_of=32, description="per 4-bit scale")
    objective: Objective | None = Field(
        default=None,
        description="what a step's loss measures: classification (cross-entropy over the task's single-token "
        "answers) or lm (cross-entropy over the whole vocabulary); default: classification for a classification "
        "task whose answers are single tokens with the model's tokenizer, lm otherwise or when answer_len > 1",
    )
    privacy: Privacy | None = Field(default=None, description="a private job (default: not private)")
    optimizer: Optimizer = Field(
        default="sgd",
        description="how the step's projected gradients move B (shared.zo_optim): sgd, momentum (an exponential "
        "average of the updates, beta 0.9) or normalized (the update over the root mean square of recent g); the "
        "program runs it, the server's replay rebuilds its state from the log",
    )
    probe_weights: ProbeWeights = Field(default="none", description=PROBE_WEIGHTS_HELP)

    # Which of the tuned values (``defaults.TUNED``, and alpha) took the defaults (not given): a federated job's spec
    # is rebuilt with its cohort's task, whose objective the defaults depend on (``server.routes.cohorts``).
    _defaulted: set[str] = PrivateAttr(default_factory=set)

    def task_kind(self) -> str | None:
        """The task's kind where the spec has a task (``TaskSpec``); None here."""
        return None

    @property
    def defaulted(self) -> set[str]:
        return set(self._defaulted)

    @model_validator(mode="after")
    def _consistent(self) -> HyperParams:
        kind = self.task_kind()
        if self.objective is None and kind is not None:
            self.objective = defaults.default_objective(kind, getattr(self, "answer_len", None))
        chosen = defaults.for_method(self.method, self.quantize, self.objective)  # values shown to learn
        self._defaulted = {name for name in (*defaults.TUNED, "alpha") if getattr(self, name) is None}
        for name in self._defaulted - {"alpha"}:
            setattr(self, name, getattr(chosen, name))
        if self.alpha is None:
            self.alpha = defaults.alpha_for(self.rank)
        q_defaulted = self.q is None
        if q_defaulted:
            self.q = defaults.q_for(self.method)
        try:
            examples_per_query(self.batch_size, self.q)
        except FieldError as exc:
            if not q_defaulted:
                raise
            raise FieldError("batch_size", f"{exc.reason}, the default q: give q (a divisor of the batch)") from None
        try:
            check_schedule(self.steps, self.lr_schedule, self.warmup_steps, self.lr_floor)
        except UsageError as exc:
            raise FieldError(exc.field, exc.reason) from None
        if self.eval_every is not None and self.steps // self.eval_every > MAX_EVALS:
            raise FieldError("eval_every", f"{self.steps} steps every {self.eval_every} is over {MAX_EVALS} points")
        if len(set(self.targets)) != len(self.targets) or not all(t.isidentifier() for t in self.targets):
            raise FieldError("targets", "module names must be distinct identifiers like q_proj")
        if self.privacy is not None and self.batch_size > self.privacy.min_examples:
            raise FieldError("privacy", f"a batch of {self.batch_size} needs min_examples >= {self.batch_size}")
        if self.probe_weights != "none" and (
            self.method != "mobizo" or self.parallel != "both" or self.privacy is not None
        ):
            reason = "curvature weights take a mobizo job of parallel both that is not private"
            raise FieldError("probe_weights", reason)
        return self


class JobCreate(TaskSpec, HyperParams):
    model_config = ConfigDict(extra="forbid")

    model: Line = Field(min_length=1, max_length=128, description="a registered model's name")
    answer_len: int | None = Field(default=None, ge=1, le=256, description="default: from the task's verbalizer")
    device_id: int | None = Field(
        default=None, ge=1, le=MAX_DB_INT, description="run on this device only (default: any that fits)"
    )
    device_backend: DeviceBackend | None = Field(default=None, description="only devices with this backend")
    init_adapter_id: int | None = Field(default=None, ge=1, le=MAX_DB_INT, description="start from this adapter's B")
    upload: UploadMode = Field(
        default="full", description="full: the device uploads B and its log; log: the log alone (B = its replay)"
    )
    standing: bool = Field(
        default=False,
        description="a standing job: a new session each time an eligible device of yours asks for work, from the "
        "job's promoted adapter, on the data the device holds then; a session's version is promoted when it lowers "
        "the held-out loss of the version it started from (docs/guide/jobs.md)",
    )
    sessions: int | None = Field(
        default=None, ge=1, le=100_000, description="a standing job: end after this many sessions (default: never)"
    )

    @model_validator(mode="after")
    def _room_for_a_prompt(self) -> JobCreate:
        if self.answer_len is not None:
            check_prompt_room(self.seq_len, self.answer_len)
        return self

    @model_validator(mode="after")
    def _standing(self) -> JobCreate:
        if self.sessions is not None and not self.standing:
            raise FieldError("sessions", "only a standing job has sessions")
        if self.standing and self.eval_examples == 0:
            raise FieldError("eval_examples", "a standing job needs held-out examples: promotion compares their loss")
        if self.standing and self.privacy is not None:
            raise FieldError("standing", "a private job cannot be standing: every session would spend the budget")
        return self


class JobSpec(TaskSpec, HyperParams):
    """What a device needs to train: the job's task and hyperparameters with ``answer_len`` resolved; ``upload``
    says whether the server wants B beside the log."""

    answer_len: int
    upload: UploadMode = "full"


# --- cohorts and federated jobs ------------------------------------------------------------------------------------


class CohortCreate(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=_NAME)
    model: Line = Field(min_length=1, max_length=128, description="a registered model's name")
    task: Line = Field(min_length=1, max_length=64, description="a built-in task name (sst2, rte, …)")

    @model_validator(mode="after")
    def _known_task(self) -> CohortCreate:
        from shared.errors import UsageError
        from shared.tasks import get_task

        try:
            get_task(self.task, None, None)
        except UsageError as exc:
            raise ValueError(f"task: {exc.reason}") from None
        return self


class CohortPublic(BaseModel):
    id: int
    name: str
    model: str
    task: str
    members: int = Field(description="users opted in now")
    member: bool | None = Field(default=None, description="whether the caller is opted in (None for the admin)")
    created_at: datetime


class CohortsPublic(BaseModel):
    data: list[CohortPublic]
    count: int


class FederationSpec(BaseModel):
    """How a federated job runs its rounds (``docs/contracts.md``): K clients per round, each N local steps (the
    job's ``steps``), closed at K reports or at the timeout with at least M."""

    rounds: int = Field(ge=1, le=10_000)
    clients_per_round: int = Field(ge=1, le=10_000, description="K: the round closes when K clients reported")
    min_clients: int | None = Field(
        default=None, ge=1, le=10_000, description="M: at the timeout, close with at least M reports (default K)"
    )
    round_timeout_s: float = Field(default=600.0, gt=0, le=7 * 24 * 3600, allow_inf_nan=False)
    aggregation: Aggregation = "fedavg"
    trim_fraction: float = Field(default=0.1, ge=0, lt=0.5, description="trimmed-mean: cut this share at each end")
    global_lr: float = Field(default=1.0, gt=0, le=100, allow_inf_nan=False, description="ETA in B + ETA·aggregate")
    server_momentum: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        allow_inf_nan=False,
        description="BETA of momentum over rounds (FedAvgM): m = BETA·m + aggregate, B + ETA·m; 0: none",
    )
    max_abs_g: float | None = Field(
        default=None, gt=0, allow_inf_nan=False, description="refuse a client log with any |g| above this"
    )
    mode: Literal["sync", "buffered"] = Field(
        default="sync",
        description="sync: a round closes at K reports of its own parts, its stragglers expire; buffered: a version "
        "closes at every K verified arrivals leased from any of the last max_staleness + 1 versions, each part "
        "weighted by its staleness (1/sqrt(1 + s))",
    )
    max_staleness: int = Field(
        default=4, ge=0, le=1000, description="buffered: a part leased more than this many versions back is refused"
    )
    concurrency: int | None = Field(
        default=None, ge=1, le=100_000, description="buffered: at most this many parts in flight at once (default 2K)"
    )

    @property
    def in_flight(self) -> int | None:
        """Buffered: the parts that may be in flight at once; sync: None (K per round)."""
        if self.mode != "buffered":
            return None
        return self.concurrency if self.concurrency is not None else 2 * self.clients_per_round

    @model_validator(mode="after")
    def _min_within_k(self) -> FederationSpec:
        if self.min_clients is not None and self.min_clients > self.clients_per_round:
            raise FieldError("min_clients", "must not exceed clients_per_round")
        return self

    @property
    def min_reports(self) -> int:
        return self.min_clients if self.min_clients is not None else self.clients_per_round


class FederatedJobCreate(HyperParams, FederationSpec):
    """``POST /v1/cohorts/{id}/jobs``: the model and task come from the cohort; ``steps`` are each client's local
    steps per round; uploads are always log-only."""

    model_config = ConfigDict(extra="forbid")

    answer_len: int | None = Field(default=None, ge=1, le=256, description="default: from the task's verbalizer")


class RoundClientPublic(BaseModel):
    id: int
    user_id: int
    device_id: int
    status: Literal["leased", "reported", "expired"]
    seed: int = Field(description="the client's run seed: its step seeds and batch order")
    progress_step: int | None = None
    log_sha256: str | None = None
    b_sha256: str | None = Field(default=None, description="the replay of its log from the round's B")
    mean_loss: float | None = None
    replay_s: float | None = None
    log_bytes: int | None = None
    counted_in_round_id: int | None = Field(
        default=None, description="the round whose close aggregated its report (buffered: maybe a later one)"
    )


class RoundPublic(BaseModel):
    id: int
    index: int
    status: Literal["open", "closing", "closed", "failed"]
    b_sha256: str = Field(description="B_r, the round's starting B")
    momentum_sha256: str | None = Field(
        default=None, description="m_r, the server's momentum the round starts with (server_momentum > 0)"
    )
    deadline_at: datetime | None
    reopened: int
    adapter_id: int | None = Field(description="the cohort adapter version this round published (B_{r+1})")
    mean_loss: float | None
    aggregate_s: float | None
    closed_at: datetime | None
    clients: list[RoundClientPublic] = Field(description="in aggregation order (reported ones are the summands)")


class RoundsPublic(BaseModel):
    data: list[RoundPublic]
    count: int


class RoundReportPublic(BaseModel):
    """A round client's accepted log: ``b_sha256`` is the replay of it from the round's B."""

    client_id: int
    round: int
    b_sha256: str


class FederationProgress(BaseModel):
    round: int | None = Field(description="the round in progress (or the last one)")
    rounds: int
    clients_leased: int
    clients_reported: int
    last_mean_loss: float | None = Field(description="mean training loss of the last closed round's clients")


class JobProgress(BaseModel):
    step: int | None = None
    loss: float | None = None
    steps_per_s: float | None = None


class JobPublic(BaseModel):
    id: int
    status: JobStatus
    model: str
    task: str = Field(description="the registry's task key: the task name, or custom-<hash> for a template")
    spec: JobCreate
    error: str | None = None
    progress: JobProgress
    attempts: int = Field(description="leases handed out so far")
    adapter_id: int | None = None
    held_out: HeldOut | None = Field(default=None, description="the adapter's held-out figures, once there is one")
    created_at: datetime
    updated_at: datetime
    cohort_id: int | None = None
    federation: FederationSpec | None = None
    federation_progress: FederationProgress | None = None
    standing_job_id: int | None = Field(default=None, description="a session: the standing job it is a session of")
    sessions_run: int | None = Field(
        default=None, description="a standing job: its sessions that published a version (adapter_id: the promoted)"
    )


class JobsPublic(BaseModel):
    data: list[JobPublic]
    count: int


# --- leases, heartbeats, results ------------------------------------------------------------------------------------


BLOBS_PATH = "/v1/blobs"


def blob_url(sha256: str) -> str:
    """Where a device downloads the file whose content is ``sha256``: the one download route."""
    return f"{BLOBS_PATH}/{sha256}"


class FileRef(BaseModel):
    """A download: ``url`` is a path relative to the server root (``blob_url``); verify ``sha256`` after
    downloading."""

    url: str
    size: int
    sha256: str


class LeaseCreate(_Strict):
    """What a device reports when it asks for work; it is leased only jobs that fit what it reports."""

    backend: DeviceBackend | None = Field(default=None, description="the backend this run uses (default: enrolled)")
    memory_mb: int | None = Field(
        default=None, ge=0, le=MAX_DB_INT, description="free memory where the training steps run"
    )
    eligible: StrictBool | None = Field(
        default=None, description="the device's policy holds (charging, battery, temperature…): round work only then"
    )
    cpu: CpuReport | None = Field(default=None, description="the device's CPU where it trains (default: as reported)")


def decimal_up_to(largest: int) -> str:
    """A regular expression (no anchors) of the decimal integers 1..``largest``, without leading zeros: a pattern
    OpenAPI states, so that an id past the ids' range is refused by the schema itself."""
    digits = str(largest)
    options = [f"[1-9][0-9]{{0,{len(digits) - 2}}}"] if len(digits) > 1 else []
    for i, digit in enumerate(digits):  # numbers of len(digits) digits that first fall below ``largest`` at digit i
        low = "1" if i == 0 else "0"
        if int(digit) > int(low):
            options.append(
                f"{digits[:i]}[{low}-{int(digit) - 1}]" + (f"[0-9]{{{len(digits) - i - 1}}}" * (i < len(digits) - 1))
            )
    options.append(digits)
    return "(" + "|".join(options) + ")"


# A leased work item's name in the work exchange (``/v1/work/{work}/{heartbeat,fail,result}``): a personal job,
# ``job-{job id}``, or a device's part in a federated round, ``part-{round client id}``; the id at most MAX_DB_INT.
WORK_KINDS = ("job", "part")
WORK_NAME = rf"^(job|part)-{decimal_up_to(MAX_DB_INT)}$"


def work_name(job_id: int, client_id: int | None = None) -> str:
    """``job-{job_id}``, or ``part-{client_id}`` for a part in a round."""
    return f"job-{job_id}" if client_id is None else f"part-{client_id}"


class RoundLeasePublic(BaseModel):
    """A lease on a part of a federated round: train ``spec.steps`` local steps from ``init`` (B_r), upload the log."""

    client_id: int
    index: int = Field(description="the round")
    deadline_at: datetime | None = Field(description="the round closes by then; a later upload is refused (409)")


class LeasePublic(BaseModel):
    job_id: int
    attempt: int
    spec: JobSpec
    manifest: ProgramManifest = Field(description="the program's manifest (config, lora names and shapes, files, …)")
    program: FileRef
    weights: FileRef = Field(description="the base weights (.ptd) the program loads")
    tokenizer: FileRef = Field(description="the model's tokenizer.json, to encode the device's data")
    init: FileRef | None = Field(default=None, description="starting B (safetensors b_flat); set it before step 1")
    expires_at: datetime
    heartbeat_s: int = Field(description="send a heartbeat at least this often to keep the lease")
    round: RoundLeasePublic | None = Field(default=None, description="set for a federated round's work")

    @property
    def work(self) -> str:
        """The work item's name in the work exchange: ``job-{job id}``, or ``part-{round client id}``."""
        return work_name(self.job_id, self.round and self.round.client_id)

    @property
    def work_path(self) -> str:
        """Where this lease's heartbeats, result and failure go (``/v1/work/{work}/…``)."""
        return f"/v1/work/{self.work}"

    @property
    def work_key(self) -> str:
        """A name for this piece of work, unique on the device (a job runs many rounds)."""
        return f"{self.job_id}-r{self.round.index}-c{self.round.client_id}" if self.round else str(self.job_id)

    @property
    def resumable(self) -> bool:
        """Whether the device may come back to this work after letting it go (paused past its limit): a job's
        lease is left to expire and its folder kept, to resume from its log; a round part is given back at once
        (the round moves on without it) and forgotten."""
        return self.round is None

    @property
    def event_fields(self) -> dict[str, int]:
        """What the agent's events say of this work beyond its job id: a round part's round and client id."""
        return {} if self.round is None else {"round": self.round.index, "client_id": self.round.client_id}


class HeartbeatCreate(_Strict):
    step: int = Field(ge=0, le=MAX_DB_INT)
    loss: float | None = Field(
        default=None,
        ge=0,
        le=MAX_LOSS,
        allow_inf_nan=False,
        description="the step's mean path loss; a private job's carries none",
    )
    steps_per_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    paused: StrictBool = Field(default=False, description="training is paused: the device's policy does not hold now")


class HeartbeatPublic(BaseModel):
    cancelled: bool = Field(description="true: stop training and drop the job")
    status: JobStatus
    expires_at: datetime


class JobFailureCreate(_Strict):
    """A device gives up on its leased job (unreadable local data, a program that does not load, …)."""

    error: Report = Field(
        description="why (at most 4000 characters; control characters but tabs and newlines are stored as escapes, "
        "\\x00, and the escaped text cut to 4000 characters: a report is never refused for what it holds)"
    )


class ResultPublic(BaseModel):
    adapter_id: int
    version: int


_Count = Annotated[int, Field(ge=0, le=_MAX_INT64)]
_Finite = Annotated[float, Field(allow_inf_nan=False)]
_NonNegative = Annotated[float, Field(ge=0, le=1e12, allow_inf_nan=False)]  # seconds, megabytes
_Loss = Annotated[float, Field(ge=0, le=MAX_LOSS, allow_inf_nan=False)]
_Fraction = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
_Text = Annotated[Line, Field(max_length=256)]


class _Metrics(BaseModel):
    """Unknown keys are dropped, not refused: an agent newer than the server still uploads; nested objects exist only
    where a field declares one, so depth is bounded by the schema; NaN and Infinity are refused."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


def perplexity(loss: float | None) -> float | None:
    """exp of a mean per-token loss in nats: a language model's perplexity on that text (None without a loss, or
    past the float range)."""
    if loss is None or loss > _MAX_EXP:
        return None
    return math.exp(loss)


_MAX_EXP = 709.0  # exp(709.78...) is the largest float


class EvalMetrics(_Metrics):
    """One evaluation during or after training (``device_agent.evaluation``)."""

    step: _Count | None = None
    accuracy: _Fraction | None = None
    loss: _Loss | None = None
    n: _Count | None = None
    perplexity: float | None = Field(
        default=None,
        exclude_if=lambda value: value is None,
        description="an lm task's: exp(loss), the loss being the mean per-token loss (set from the loss, whatever "
        "the device sent; absent for other tasks)",
    )

    @model_validator(mode="after")
    def _perplexity_of_the_loss(self) -> EvalMetrics:
        if self.perplexity is not None:  # marked as an lm figure: the value is the loss's, never a claim of its own
            self.perplexity = perplexity(self.loss)
        return self


class HeldOut(BaseModel):
    """What personalization did on the device's held-out slice of its own data: the base (``before``, step 0) and
    the trained adapter (``after``), measured on the device by the program; no example leaves the device. With
    the job's ``eval_every``, ``curve`` holds every measurement, step by step."""

    n: int | None = None
    before: EvalMetrics
    after: EvalMetrics
    curve: list[EvalMetrics] | None = None

    @classmethod
    def from_metrics(cls, metrics: dict[str, Any]) -> HeldOut | None:
        """From an upload's ``eval`` entries (first and last; all of them as the curve when there are more than
        two), or None when the device measured nothing."""
        evals = [EvalMetrics.model_validate(e) for e in metrics.get("eval") or []]
        if len(evals) < 2:
            return None
        return cls(n=evals[-1].n, before=evals[0], after=evals[-1], curve=evals if len(evals) > 2 else None)


class UploadMetrics(_Metrics):
    """The ``metrics`` part of a result upload (``device_agent.metrics.training_metrics``), validated before it is
    stored with the adapter; stored as sent (``exclude_unset``), less unknown keys, plus the server's ``server``. A
    private job's keeps only ``PRIVATE_METRICS`` (``server.verify.parse_metrics``)."""

    method: _Text | None = None
    q: _Count | None = None
    batch_size: _Count | None = None
    examples_per_query: _Count | None = None
    steps: _Count | None = None
    losses: list[_Loss] | None = Field(
        default=None,
        max_length=1_000_000,
        description="per step: mean path loss (the server stores the means of the verified log's losses instead)",
    )
    step_time_s: _NonNegative | None = None
    train_time_s: _NonNegative | None = None
    peak_rss_mb: _NonNegative | None = None
    eval: list[EvalMetrics] | None = Field(default=None, max_length=10_000)
    seq_len: _Count | None = None
    answer_len: _Count | None = None
    rank: _Count | None = None
    alpha: _Finite | None = None
    targets: list[_Text] | None = Field(default=None, max_length=64)
    a_seed: _Count | None = None
    optimizer: _Text | None = None
    program_sha256: _Text | None = None
    seed: _Count | None = None
    lr: _Finite | None = None
    eps: _Finite | None = None
    task: _Text | None = None
    backend: _Text | None = None
    job_id: _Count | None = None
    log_sha256: _Text | None = None
    n_train: _Count | None = None


# What a private job's metrics keep (the rest is dropped, not stored): the job's own parameters, numbers the spec
# fixed before any data was read, and ``losses`` and ``eval``, which are refused unless empty (null, []: the agent
# says so). Free text (method, targets, task, backend, optimizer, hashes), timings (step_time_s, train_time_s,
# peak_rss_mb) and counts of the data (n_train) are the device's to keep (``server.verify.parse_metrics``).
PRIVATE_METRICS = frozenset(
    {"q", "batch_size", "examples_per_query", "steps", "seq_len", "answer_len", "rank", "alpha", "a_seed", "seed"}
    | {"lr", "eps", "job_id", "losses", "eval"}
)


# --- adapters, health ---------------------------------------------------------------------------------------------


class AdapterPrivacy(BaseModel):
    """What a private job's adapter was trained under: (epsilon, delta)-DP for each of the device's examples, the
    noise multiplier sigma, the clip C per example, the steps and the sampling rate (batch / min_examples) the
    accountant counted."""

    epsilon: float
    delta: float
    noise_multiplier: float
    clip: float
    steps: int
    sampling_rate: float


class AdapterPrompt(BaseModel):
    """How an adapter must be prompted: the contract of its card (``shared.adapter.make_card``), with the chat frame
    itself, so a device that holds no tokenizer configuration frames its prompts as training did."""

    task: str = Field(description="the task it was trained on (a built-in task's name, or custom)")
    template: str | None = Field(description="the prompt, with {field} placeholders; None: the task's own")
    verbalizer: dict[str, str] | None = Field(description="label -> answer text; None: the task's own")
    chat: list[str] | None = Field(
        description="the model's chat template around one user message (before, after the prompt); None: plain"
    )
    objective: str = Field(description="the loss it trained: classification or lm")
    prior: list[float] = Field(
        description="the content-free prior divided out of the answers' scores (contextual calibration); empty: none"
    )


class AdapterPublic(BaseModel):
    id: int
    model: str
    task: str
    version: int = Field(description="1, 2, … per (user, model, task), or per cohort for a cohort's adapter")
    job_id: int
    cohort_id: int | None = Field(default=None, description="set for a cohort's adapter (owned by the cohort)")
    round: int | None = Field(default=None, description="the round of the cohort's job that published it")
    parent_adapter_id: int | None = Field(description="the adapter this one started from, if any")
    rank: int
    alpha: float
    targets: list[str]
    a_seed: int
    b_sha256: str
    base_sha256: str = Field(
        description="the base model it was trained on (its config, weights and tokenizer): the archive pins it, and "
        "mobizo eval and generate refuse another base"
    )
    metrics: dict[str, Any]
    held_out: HeldOut | None = Field(default=None, description="accuracy and loss on the device's held-out data")
    promoted: bool | None = Field(
        default=None,
        description="a standing job's session's version: whether it lowered the held-out loss of the version it "
        "started from, and so became the job's adapter; None: not a session's",
    )
    privacy: AdapterPrivacy | None = Field(default=None, description="a private job's guarantee; None: not private")
    prompt: AdapterPrompt | None = Field(
        default=None, description="how it must be prompted (its card's contract); None: an adapter without a job"
    )
    created_at: datetime


class AdaptersPublic(BaseModel):
    data: list[AdapterPublic]
    count: int


class HealthPublic(BaseModel):
    status: Literal["ok", "degraded"]
    database: Literal["ok", "unreachable"]


# --- errors ---------------------------------------------------------------------------------------------------------


class ErrorItem(BaseModel):
    loc: list[str | int] = Field(description="where: body, path, query or header, then the field")
    msg: str
    type: str


class ErrorPublic(BaseModel):
    """Every 4xx answer: a message, or (validation errors) the fields at fault; never the offending input."""

    detail: str | list[ErrorItem]


JobPublic.model_rebuild()  # its held_out is declared below it, with the metrics it summarises


class InferenceCreate(_Strict):
    """The inference program a device asks for: a model and the LoRA layout of the adapters it will run (an
    adapter's ``rank``, ``alpha``, ``targets``, ``a_seed``), with ``max_context`` positions of KV cache."""

    model: Line = Field(min_length=1, max_length=128)
    config: InferenceConfig = Field(default_factory=InferenceConfig)


class InferencePublic(BaseModel):
    """A compiled inference program and its downloads (the weights are the model's training programs' file)."""

    key: str
    manifest: InferenceManifest
    program: FileRef
    weights: FileRef
    tokenizer: FileRef
