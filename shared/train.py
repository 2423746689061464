"""Training loops of the four methods (``mobizo``, ``mezo-lora``, ``mezo``, ``fo-lora``) and ``metrics.json``.

Every method runs the same loop, so the only thing that differs between two runs is the step:
step k trains on examples ``batch_indices(n, batch_size, seed, k)`` with step seed ``step_seed(seed, k)``.
Both are pure functions of (run seed, k), so runs are reproducible and a device program fed the same data sees the
same seeds. For ``mobizo`` the q*E examples form ONE left-padded batch, query-major (rows i*E..(i+1)*E-1 are query
i); the schedules that run queries separately trim their padding themselves (``shared.zo``).

Outputs (written at the end, each atomically): ``OUT/metrics.json`` (docs/contracts.md), ``OUT/adapter/``
(PEFT layout; not for ``mezo``, which trains the full model and leaves no adapter) and, for ``mobizo``,
``OUT/train_log.jsonl`` (docs/contracts.md: replaying it from B = 0 rebuilds the adapter's B bit for bit).
``mezo-lora`` writes no log because its in-place ± walk does not restore B bit for bit, so a replay would not
match exactly.
"""

from __future__ import annotations

import functools
import json
import math
import secrets
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from shared import defaults, privacy
from shared.adapter import save_lora
from shared.backends import OBJECTIVES, OPTIMIZERS, PARALLEL_MODES, PROBE_WEIGHTS
from shared.baselines import fo_lora_step, mezo_lora_step, mezo_step
from shared.batch import Batch
from shared.checkpoint import Checkpoint, fingerprint, load_checkpoint, save_checkpoint
from shared.data import (
    Encoded,
    batch_indices,
    check_candidates,
    encode,
    load_examples,
    pad_token_id,
    resolve_objective,
    training_batch,
)
from shared.errors import FieldError, UsageError
from shared.evaluate import evaluate, measure_prior
from shared.files import atomic_write_bytes
from shared.hf_models import load_model, model_chat_frame, resolve_dtype
from shared.lora import MPLoRA, inject_lora
from shared.manifest import ProgramConfig, examples_per_query
from shared.memory import peak_rss_mb
from shared.noise import MAX_SEED, step_seed
from shared.prompts import resolve as resolve_prompt
from shared.schedule import check_schedule, lr_at
from shared.tasks import Rendered, Task, get_task, with_chat
from shared.train_log import log_line, log_record
from shared.zo import zo_step
from shared.zo_optim import new_state, step_lr, update

METHODS: tuple[str, ...] = ("mobizo", "mezo-lora", "mezo", "fo-lora")
ONE_QUERY_METHODS = ("mezo-lora", "mezo", "fo-lora")  # q must be 1: they estimate (or compute) one gradient
METRICS_FILE, LOG_FILE, ADAPTER_DIR = "metrics.json", "train_log.jsonl", "adapter"


@dataclass(frozen=True)
class TrainConfig:
    """One training run; the fields are ``mobizo train``'s flags (defaults: ``shared.defaults``)."""

    model: Path
    task: str
    train: Path
    out: Path
    eval: Path | None = None
    method: str = defaults.METHOD
    q: int | None = None  # None: the method's (shared.defaults.q_for)
    batch_size: int = defaults.BATCH_SIZE
    bucket: int = defaults.BUCKET  # batches per length bucket (shared.data.batch_indices); 1: as drawn
    steps: int | None = None  # None: the method's default for the objective (shared.defaults.TUNED)
    lr: float | None = None  # the base lr: the schedule's peak (shared.schedule)
    lr_schedule: str | None = None  # constant, linear or cosine (after the warm-up)
    # The steps the schedule spans (None: steps). Fewer steps than that run the opening of the longer run, which the
    # same --out continues bit for bit (the accuracy benchmark's learning-rate pilots).
    schedule_steps: int | None = None
    warmup_steps: int = defaults.WARMUP_STEPS
    lr_floor: float = defaults.LR_FLOOR  # where linear and cosine decay end, a fraction of lr
    eps: float | None = None
    rank: int | None = None
    alpha: float | None = None  # None: defaults.alpha_for(rank)
    targets: tuple[str, ...] = defaults.TARGETS
    seed: int = defaults.SEED
    a_seed: int = defaults.A_SEED  # seeds the frozen A (as in exported programs), independent of the run seed
    parallel: str = "both"
    dtype: str = "float32"
    eval_every: int | None = None
    checkpoint_every: int | None = (
        None  # write OUT/checkpoint/ every K steps; a run resumes from it (shared.checkpoint)
    )
    device: str | None = None  # None: cuda when available, else cpu
    limit_train: int | None = None
    limit_eval: int | None = None
    seq_len: int | None = None  # prompts are cut from the left so prompt + answer fits
    template: str | None = None
    verbalizer: dict[str, str] | None = None
    chat_template: bool = False  # prompts inside the model's chat template (instruct models)
    # A built-in task without a template: "model", the prompt chosen for the model where it has one
    # (``shared.prompts.resolve``); "builtin", the task's own.
    prompt: str = "model"
    # The classification objective: divide the prompt's content-free prior (``shared.calibration``; measured once on
    # the base model) out of the candidates' scores, in the loss and in every evaluation.
    calibrate: bool = False
    objective: str | None = None  # None: the task's default (shared.data.resolve_objective)
    optimizer: str = "sgd"  # how g moves B (shared.zo_optim; mobizo only): sgd, momentum or normalized
    probe_weights: str = "none"  # how a step weighs its probes' g (shared.zo; mobizo only): none or curvature
    # A private run (shared.privacy, mobizo only): the (epsilon, delta) it may spend and the clip C of each example's
    # projected difference; None: not private.
    dp_epsilon: float | None = None
    dp_delta: float = defaults.DP_DELTA
    dp_clip: float = defaults.DP_CLIP


# ---------------------------------------------------------------------------------------------------------------
# Validation: every bad argument is reported before the (slow) model load, naming its field.


def with_defaults(config: TrainConfig) -> TrainConfig:
    """``config`` with its prompt (a built-in task given none: the model's, ``shared.prompts.resolve``), its
    objective (by default the task's, ``shared.defaults.default_objective``; the tokenizer
    checks it later) and the method's defaults for that objective for the tuned values it does not give
    (``shared.defaults.TUNED``: steps, lr, eps, rank, schedule; alpha follows the rank; q: ``defaults.q_for``)."""
    template, verbalizer, chat = resolve_prompt(
        config.model, config.task, config.template, config.verbalizer, config.chat_template, config.prompt
    )
    config = replace(config, template=template, verbalizer=verbalizer, chat_template=chat)
    objective = config.objective if config.objective is not None else _default_objective(config)
    chosen = defaults.for_method(config.method, objective=objective)
    missing = {name: getattr(chosen, name) for name in defaults.TUNED if getattr(config, name) is None}
    q = config.q if config.q is not None else defaults.q_for(config.method)
    config = replace(config, objective=objective, q=q, **missing)
    return config if config.alpha is not None else replace(config, alpha=defaults.alpha_for(config.rank))


def _default_objective(config: TrainConfig) -> str:
    """The objective of a run that names none: the task's (``shared.data.resolve_objective`` with the model's
    tokenizer: classification when the answers are single tokens); ``lm`` while the task or the model is not valid
    (``validate`` then says why)."""
    from transformers import AutoTokenizer

    from shared.data import resolve_objective

    try:
        task = get_task(config.task, config.template, config.verbalizer)
        tokenizer = AutoTokenizer.from_pretrained(str(config.model), local_files_only=True)
        if config.chat_template:
            task = with_chat(task, model_chat_frame(config.model))
        return resolve_objective(task, tokenizer)[0]
    except (UsageError, OSError, ValueError):
        return "lm"


def validate(config: TrainConfig) -> Task:
    """Check every argument (``UsageError`` naming the field); returns the task."""
    config = with_defaults(config)
    _check_method(config)
    _check_numbers(config)
    _check_paths(config)
    resolve_dtype(config.dtype)
    resolve_device(config.device)
    task = get_task(config.task, config.template, config.verbalizer)
    return with_chat(task, model_chat_frame(config.model)) if config.chat_template else task


def _check_method(config: TrainConfig) -> None:
    if config.method not in METHODS:
        raise UsageError("method", f"unknown method {config.method!r} (choose from {', '.join(METHODS)})")
    if config.objective is not None and config.objective not in OBJECTIVES:
        raise UsageError("objective", f"unknown objective {config.objective!r} (choose from {', '.join(OBJECTIVES)})")
    if config.parallel not in PARALLEL_MODES:
        raise UsageError("parallel", f"unknown mode {config.parallel!r} (choose from {', '.join(PARALLEL_MODES)})")
    if config.q < 1:
        raise UsageError("q", f"must be at least 1, got {config.q}")
    if config.method in ONE_QUERY_METHODS and config.q != 1:
        raise UsageError("q", f"{config.method} uses one query per step: --q must be 1, got {config.q}")
    if config.optimizer not in OPTIMIZERS:
        raise UsageError("optimizer", f"unknown optimizer {config.optimizer!r} (choose from {', '.join(OPTIMIZERS)})")
    if config.optimizer != "sgd" and config.method != "mobizo":
        raise UsageError("optimizer", f"{config.optimizer} moves a mobizo run's B; {config.method} takes sgd")
    if config.probe_weights not in PROBE_WEIGHTS:
        choices = ", ".join(PROBE_WEIGHTS)
        raise UsageError("probe_weights", f"unknown weights {config.probe_weights!r} (choose from {choices})")
    if config.probe_weights != "none" and (
        config.method != "mobizo" or config.parallel != "both" or config.dp_epsilon is not None
    ):
        raise UsageError("probe_weights", "curvature weights take a mobizo run of parallel both that is not private")
    if config.dp_epsilon is not None and config.method != "mobizo":
        raise UsageError("dp_epsilon", f"a private run is a mobizo run (its g is privatized), not {config.method}")
    if config.method == "mezo" and config.checkpoint_every is not None:
        raise UsageError("checkpoint_every", "mezo trains all parameters, whose state is not checkpointed")
    try:
        examples_per_query(config.batch_size, config.q)
    except FieldError:
        reason = (
            f"{config.q} must divide --batch-size {config.batch_size} (each query gets batch_size/q examples; "
            f"a mobizo run's default q is {defaults.Q})"
        )
        raise UsageError("q", reason) from None


def schedule_span(config: TrainConfig) -> int:
    """The steps the run's lr schedule spans: ``schedule_steps``, else ``steps``."""
    return config.schedule_steps if config.schedule_steps is not None else config.steps


def _check_numbers(config: TrainConfig) -> None:
    at_least = (
        ("batch_size", config.batch_size, 1),
        ("bucket", config.bucket, 1),
        ("steps", config.steps, 1),
        ("rank", config.rank, 1),
        ("eval_every", config.eval_every, 1),
        ("checkpoint_every", config.checkpoint_every, 1),
        ("limit_train", config.limit_train, 1),
        ("limit_eval", config.limit_eval, 1),
        ("seq_len", config.seq_len, 2),
    )
    for field, value, least in at_least:
        if value is not None and value < least:
            raise UsageError(field, f"must be at least {least}, got {value}")
    for field, value in (("lr", config.lr), ("eps", config.eps), ("alpha", config.alpha)):
        if not (math.isfinite(value) and value > 0):
            raise UsageError(field, f"must be a positive number, got {value}")
    private = (("dp_epsilon", config.dp_epsilon), ("dp_clip", config.dp_clip)) if config.dp_epsilon is not None else ()
    for field, value in private:
        if not (math.isfinite(value) and value > 0):
            raise UsageError(field, f"must be a positive number, got {value}")
    if not 0 < config.dp_delta < 1:
        raise UsageError("dp_delta", f"must be in (0, 1), got {config.dp_delta}")
    if not 0 <= config.seed < MAX_SEED:
        raise UsageError("seed", f"must be in [0, 2**31), got {config.seed}")
    if config.schedule_steps is not None and config.schedule_steps < config.steps:
        raise UsageError("schedule_steps", f"must be at least steps ({config.steps}), got {config.schedule_steps}")
    check_schedule(schedule_span(config), config.lr_schedule, config.warmup_steps, config.lr_floor)
    if not config.targets or not all(config.targets):
        raise UsageError("targets", "needs at least one module name, e.g. q_proj,v_proj")


def _check_paths(config: TrainConfig) -> None:
    if not (Path(config.model) / "config.json").is_file():
        raise UsageError("model", f"{config.model} is not a Hugging Face model folder (no config.json)")
    if not Path(config.train).is_file():
        raise UsageError("train", f"no such file: {config.train}")
    if config.eval is not None and not Path(config.eval).is_file():
        raise UsageError("eval", f"no such file: {config.eval}")
    if config.eval is None and config.eval_every is not None:
        raise UsageError("eval_every", "needs --eval FILE to evaluate on")
    if Path(config.out).exists() and not Path(config.out).is_dir():
        raise UsageError("out", f"{config.out} exists and is not a folder")


def resolve_device(name: str | None) -> torch.device:
    """``None`` → cuda when available, else cpu; a CUDA device that is not there is a usage error."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError("device", f"unknown device {name!r} (use cpu or cuda)") from None
    if device.type not in ("cpu", "cuda"):
        raise UsageError("device", f"unsupported device {name!r} (use cpu or cuda)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("device", "CUDA is not available on this machine")
    return device


# ---------------------------------------------------------------------------------------------------------------
# The step of each method, behind one callable (also what benchmarks/step_time.py times).


class ZerothOrderOut(NamedTuple):
    """What a zeroth-order step returns: the path losses (2q; 3q with curvature weights) and the projected
    gradients g [q], the log's."""

    losses: torch.Tensor
    g: torch.Tensor


class FirstOrderOut(NamedTuple):
    """What a first-order step returns: its one path's loss [1] and the norm of B's gradient [1] (a first-order
    step has no g to log: what moved B was the whole gradient)."""

    losses: torch.Tensor
    grad_norm: torch.Tensor


class Step(Protocol):
    """What the training loop trains through: a step of either order, eager (``MethodStep``) or a program's in the
    ExecuTorch runtime (``benchmarks.program_steps``). ``b``: the flat master B the step starts from and leaves
    (None for ``mezo``, which trains the model itself); a run resumed from a checkpoint writes it before the first
    call. ``device``: where the step's batches go. A zeroth-order step also keeps an optimizer's ``opt_state`` and
    takes a private run's ``privatizer`` (``ZerothOrderStep``)."""

    b: torch.Tensor | None
    device: torch.device

    def __call__(self, batch: Batch, seed: int, lr: float) -> ZerothOrderOut | FirstOrderOut: ...


class ZerothOrderStep(Step, Protocol):
    """A zeroth-order step: its optimizer's state (checkpointed with B), and a private run's clip and noise."""

    opt_state: dict[str, torch.Tensor]
    privatizer: privacy.Privatizer | None


class MethodStep:
    """One method's step and the state it updates: the flat master B (LoRA methods) or the model itself (mezo).

    ``step(batch, seed, lr)``: ``ZerothOrderOut`` (the 2q path losses and the projected gradients), or for fo-lora
    ``FirstOrderOut``. ``lr`` is the step's (``shared.schedule.lr_at``; None: the constructor's); lr, eps and the
    seed go in as tensors on the model's device, as the exported program takes them.
    """

    def __init__(
        self,
        method: str,
        model: nn.Module,
        lora: MPLoRA | None,
        q: int = 1,
        parallel: str = "both",
        lr: float = 1e-4,
        eps: float = 1e-2,
        optimizer: str = "sgd",
        probe_weights: str = "none",
    ) -> None:
        self.method, self.model, self.lora, self.q, self.parallel = method, model, lora, q, parallel
        self.probe_weights = probe_weights
        self.device = next(model.parameters()).device
        self.lr, self.eps = float(lr), float(eps)
        # The master B, lr and eps are float32 (the program's arithmetic), float64 for a float64 model.
        self.dtype = torch.float64 if next(model.parameters()).dtype == torch.float64 else torch.float32
        self.eps_t = torch.tensor([eps], dtype=self.dtype, device=self.device)
        self.b = None if method == "mezo" else lora.zeros(self.dtype)
        self.privatizer: privacy.Privatizer | None = None  # set for a private run (mobizo)
        self.optimizer = optimizer
        self.opt_state = {} if self.b is None else new_state(optimizer, self.b.shape[0], self.dtype, self.device)

    def _apply(self, b: torch.Tensor, z: torch.Tensor, g: torch.Tensor, lr: torch.Tensor) -> torch.Tensor:
        """The optimizer's update (``shared.zo_optim``), its state kept here."""
        b_new, self.opt_state = update(self.optimizer, b, z, g, lr, self.opt_state)
        return b_new

    def _private(self) -> dict[str, torch.Tensor]:
        """A private step's clip and noise (``zo_step``'s), as tensors on the model's device; none otherwise."""
        if self.privatizer is None:
            return {}
        clip = torch.tensor([self.privatizer.clip], dtype=self.dtype, device=self.device)
        noise = torch.from_numpy(self.privatizer.noise(self.q))  # NumPy's draw, as every backend's
        return {"clip": clip, "g_noise": noise.to(self.device, self.dtype)}

    def __call__(self, batch: Batch, seed: int, lr: float | None = None) -> ZerothOrderOut | FirstOrderOut:
        lr = self.lr if lr is None else float(lr)
        seed_t = torch.tensor([seed], dtype=torch.int64, device=self.device)
        lr_t = torch.tensor([lr], dtype=self.dtype, device=self.device)  # the step's lr, as the program takes it
        with torch.no_grad():  # fo-lora turns gradients back on for its own backward pass
            if self.method == "mobizo":
                losses, g, self.b = zo_step(
                    self.model,
                    self.lora,
                    batch,
                    self.b,
                    seed_t,
                    lr_t,
                    self.eps_t,
                    self.q,
                    self.parallel,
                    apply=self._apply,
                    probe_weights=self.probe_weights,
                    **self._private(),
                )
                return ZerothOrderOut(losses, g)
            if self.method == "mezo-lora":
                return ZerothOrderOut(*mezo_lora_step(self.model, self.lora, batch, self.b, seed_t, lr_t, self.eps_t))
            if self.method == "mezo":
                return ZerothOrderOut(*mezo_step(self.model, batch, seed, lr, self.eps))
            return FirstOrderOut(*fo_lora_step(self.model, self.lora, batch, self.b, lr_t))


def to_device(batch: Batch, device: torch.device) -> Batch:
    return Batch(*(None if (t := getattr(batch, f.name)) is None else t.to(device) for f in fields(Batch)))


# ---------------------------------------------------------------------------------------------------------------
# The run


@dataclass
class _Run:
    """What a run holds while it trains."""

    config: TrainConfig
    task: Task
    model: nn.Module
    tokenizer: Any
    lora: MPLoRA | None
    step: Step
    train: list[Encoded]
    eval: list[Rendered] | None
    objective: str
    candidates: torch.Tensor | None  # the classification objective's candidate ids, on the model's device
    answer_len: int | None  # the objective's answer columns (None: the longest answer of each batch)
    widths: tuple[int | None, int | None] = (None, None)  # a program's (seq_len, answer_len); None: the batch's
    private: dict[str, Any] | None = None  # a private run's noise (``_private_seed``)
    prior: tuple[float, ...] | None = None  # the prompt's content-free prior (``TrainConfig.calibrate``)

    @functools.cached_property
    def lengths(self) -> list[int] | None:
        """Each training example's prompt tokens, for length buckets (``TrainConfig.bucket`` > 1); read once."""
        return [len(e.prompt_ids) for e in self.train] if self.config.bucket > 1 else None


# Another implementation of a run's step, in MethodStep's place: ``factory(program, lora) -> Step``, given the
# program config of the run (``program_config``) and its LoRA layout; the loop then builds its batches at the
# program's shape. benchmarks/accuracy.py's ``--runner program`` passes the exported program in the ExecuTorch
# runtime (``benchmarks.program_steps``): the device's step inside this loop, its data, evaluation and checkpoints.
StepFactory = Callable[[ProgramConfig, MPLoRA], Step]


def program_config(
    config: TrainConfig,
    objective: str,
    candidates: tuple[int, ...],
    answer_len: int | None,
    prior: tuple[float, ...] | None = None,
):
    """The device program that takes a LoRA run's step: ``config``'s q, batch and adapter, its objective resolved
    (``shared.data.resolve_objective``); ``mezo-lora`` is the one-query program whose two paths run one after the
    other (``parallel`` none), and so is ``fo-lora``'s config (its program, ``shared.fo_program``, takes the batch's
    rows once, forward and backward). ``UsageError`` naming the field a program cannot have."""
    if config.method not in ("mobizo", "mezo-lora", "fo-lora"):
        raise UsageError("method", f"{config.method} has no device program (mobizo, mezo-lora and fo-lora have)")
    if config.seq_len is None:
        raise UsageError("seq_len", "a program has a longest row: give seq_len")
    if answer_len is None:
        raise UsageError("answer_len", "the task's answers come from the data: a program needs their length")
    one_query = config.method in ("mezo-lora", "fo-lora")
    spec = {name: getattr(config, name) for name in ("batch_size", "seq_len", "rank", "alpha", "targets", "a_seed")}
    spec |= {"q": 1 if one_query else config.q, "parallel": "none" if one_query else config.parallel}
    spec |= {"program_backend": defaults.PROGRAM_BACKEND, "quantize": None, "group_size": None}
    spec |= {"optimizer": config.optimizer, "probe_weights": config.probe_weights}
    chat = model_chat_frame(config.model) if config.chat_template else None
    program = ProgramConfig.from_spec(spec, answer_len, chat, objective, candidates, prior or ())
    return program.model_copy(update={"private": True}) if config.dp_epsilon is not None else program


def _prepare(config: TrainConfig, task: Task, step_factory: StepFactory | None = None) -> _Run:
    """Load data first (a bad file fails fast), then the model; inject LoRA for the LoRA methods; the step is
    ``MethodStep``, or what ``step_factory`` makes."""
    rendered = load_examples(task, config.train, config.limit_train)
    held_out = load_examples(task, config.eval, config.limit_eval) if config.eval is not None else None
    device = resolve_device(config.device)
    model, tokenizer = load_model(Path(config.model), config.dtype, str(device))
    lora = None
    if config.method != "mezo":
        lora = inject_lora(model, config.targets, config.rank, config.alpha, config.a_seed)
    objective, ids, answer_len = resolve_objective(task, tokenizer, config.objective)
    prior = None
    if config.calibrate and objective == "classification":  # on the base model: every LoRA path is idle here
        prior = measure_prior(model, tokenizer, task, config.seq_len)
    widths: tuple[int | None, int | None] = (None, None)
    if step_factory is None:
        step = MethodStep(
            config.method,
            model,
            lora,
            config.q,
            config.parallel,
            config.lr,
            config.eps,
            config.optimizer,
            config.probe_weights,
        )
    else:  # the program's batches have its shape, as the agent's (device_agent.local_data.step_batches)
        program = program_config(config, objective, ids, answer_len, prior)
        step, widths = step_factory(program, lora), (program.seq_len, program.answer_len)
    train_set = encode(rendered, tokenizer, config.seq_len)
    candidates = None
    if objective == "classification":
        check_candidates(train_set, ids)
        candidates = torch.tensor(ids, dtype=torch.long, device=device)
    return _Run(
        config,
        task,
        model,
        tokenizer,
        lora,
        step,
        train_set,
        held_out,
        objective,
        candidates,
        answer_len,
        widths,
        prior=prior,
    )


def _evaluate(run: _Run, steps_done: int) -> dict[str, Any]:
    """Accuracy and loss on --eval with the current master B (or the current weights, for mezo)."""
    if run.lora is not None:
        run.lora.apply(run.step.b[None])
    try:
        result = evaluate(
            run.model,
            run.tokenizer,
            run.task,
            run.eval,
            max_len=run.config.seq_len,
            objective=run.objective,
            prior=run.prior,
        )
    finally:
        if run.lora is not None:
            run.lora.apply(None)
    return {"step": steps_done, "accuracy": result["accuracy"], "loss": result["loss"]}


def _due_for_eval(run: _Run, steps_done: int) -> bool:
    if run.eval is None:
        return False
    every = run.config.eval_every
    return steps_done in (0, run.config.steps) or (every is not None and steps_done % every == 0)


def _step_batch(run: _Run, k: int, private_seed: int | None) -> Batch:
    """Step k's batch: the run's walk through epochs (``batch_indices``), or for a private run a fresh uniform
    sample without replacement drawn with the device's private seed (``shared.privacy.private_batch``)."""
    cfg = run.config
    if private_seed is None:
        indices = batch_indices(len(run.train), cfg.batch_size, cfg.seed, k, run.lengths, cfg.bucket)
    else:
        indices = privacy.step_sample(private_seed, k, len(run.train), cfg.batch_size)
    examples = [run.train[i] for i in indices]
    batch = to_device(training_batch(examples, pad_token_id(run.tokenizer), *run.widths), run.step.device)
    batch.candidates = run.candidates
    if run.prior is not None:
        batch.prior = torch.tensor(run.prior, dtype=torch.float32, device=run.step.device)
    return batch


def _start(run: _Run) -> Checkpoint:
    """Step 0 with an empty history, or the run's checkpoint (which must belong to the same configuration)."""
    cfg = run.config
    # A decaying schedule's span decides every step's lr, so it is the run's; a constant one's is not (its run extends).
    span = None if cfg.lr_schedule == "constant" else schedule_span(cfg)
    wanted = fingerprint(asdict(cfg) | {"schedule_steps": span})
    if cfg.optimizer == "sgd":  # the fingerprint of a run made before there were optimizers
        del wanted["optimizer"]
    if cfg.probe_weights == "none":  # and before there were probe weights
        del wanted["probe_weights"]
    history: dict[str, list] = {"losses": [], "times": [], "log": [], "eval": []}
    b = run.step.b if run.step.b is not None else torch.zeros(0)
    found = load_checkpoint(cfg.out) if cfg.checkpoint_every is not None else None
    if found is None:
        return Checkpoint(0, b, history, wanted)
    if found.fingerprint != wanted:
        changed = sorted(k for k in wanted if found.fingerprint.get(k) != wanted[k])
        if changed == ["schedule_steps"]:
            raise UsageError(
                "steps",
                f"{cfg.out} holds a run whose {cfg.lr_schedule} schedule spans {found.fingerprint['schedule_steps']} "
                f"steps; --steps {cfg.steps} would change the lr of the steps it has left (a longer run needs a new "
                "--out)",
            )
        raise UsageError("out", f"{cfg.out} holds a checkpoint of another run (differs in {', '.join(changed)})")
    if found.step > cfg.steps:
        raise UsageError("steps", f"the checkpoint in {cfg.out} is at step {found.step}, beyond --steps {cfg.steps}")
    run.step.b.copy_(found.b.to(run.step.b.device, run.step.b.dtype))
    if found.opt_state:
        run.step.opt_state = {k: v.to(run.step.b.device, run.step.b.dtype) for k, v in found.opt_state.items()}
    return found


def _at_step(run: _Run, state: Checkpoint, k: int, start: int) -> None:
    """Before step k (and after the last): evaluate when due, then checkpoint when due."""
    cfg = run.config
    if _due_for_eval(run, k) and not any(e["step"] == k for e in state.history["eval"]):
        entry = _evaluate(run, k)
        state.history["eval"].append(entry)
        if run.step.b is not None:
            state.note_eval(entry, run.step.b)
    every = cfg.checkpoint_every
    if every is not None and k != start and (k % every == 0 or k == cfg.steps):
        state.step, state.b = k, run.step.b  # mobizo's step returns a new B rather than updating it in place
        state.opt_state = getattr(run.step, "opt_state", {})
        save_checkpoint(cfg.out, state)


def _loop(run: _Run, progress: bool) -> Checkpoint:
    """Train from the start (or the checkpoint); per step: mean path loss, wall time of the step, the log record
    (mobizo); evaluations and checkpoints when due."""
    cfg = run.config
    state = _start(run)
    history, start = state.history, state.step
    private_seed = _private_seed(run, history)
    eps32 = float(np.float32(cfg.eps))
    steps = range(start, cfg.steps)
    bar = tqdm(
        steps,
        desc=cfg.method,
        unit="step",
        initial=start,
        total=cfg.steps,
        disable=not (progress and sys.stderr.isatty()),
    )
    for k in bar:
        _at_step(run, state, k, start)
        batch, seed = _step_batch(run, k, private_seed), step_seed(cfg.seed, k)
        if private_seed is not None:  # step k's noise, whatever ran before (a resumed run draws the same)
            run.step.privatizer = privacy.step_privatizer(private_seed, k, cfg.dp_clip, run.private["noise_std"])
        lr = lr_at(cfg.lr, schedule_span(cfg), k, cfg.lr_schedule, cfg.warmup_steps, cfg.lr_floor)  # float32, as logged
        lr = step_lr(cfg.optimizer, lr, k)
        begin = time.perf_counter()
        out = run.step(batch, seed, lr)
        losses = out.losses.float().cpu()  # .cpu() waits for the device
        history["times"].append(time.perf_counter() - begin)
        history["losses"].append(float(losses.mean()))
        if cfg.method == "mobizo":
            logged = None if private_seed is not None else losses.numpy()  # a private log holds g alone
            history["log"].append(log_record(k, seed, lr, eps32, out.g.float().cpu().numpy(), logged))
        bar.set_postfix(loss=f"{history['losses'][-1]:.4f}")
    _at_step(run, state, cfg.steps, start)
    state.step = cfg.steps
    return state


def _private_seed(run: _Run, history: dict[str, list]) -> int | None:
    """A private run's seed of its batches and noise: drawn once on this machine, kept in the (local) checkpoint so
    that a resumed run goes on with the same draws, never in what the run writes for others (log, metrics). Sets
    the step's privatizer, with the noise the accountant needs for the run's (epsilon, delta)."""
    cfg = run.config
    if cfg.dp_epsilon is None:
        return None
    if cfg.batch_size > len(run.train):
        raise UsageError("batch_size", f"a private batch samples {cfg.batch_size} of only {len(run.train)} examples")
    seed = history.setdefault("private_seed", [secrets.randbits(62)])[0]
    steps = schedule_span(cfg)  # the whole run's, for a run trained in pieces (``schedule_steps``)
    sigma = privacy.noise_multiplier(cfg.dp_epsilon, cfg.dp_delta, steps, cfg.batch_size, len(run.train))
    std = privacy.noise_std(sigma, cfg.dp_clip, cfg.batch_size // cfg.q)
    run.step.privatizer = privacy.step_privatizer(seed, 0, cfg.dp_clip, std)
    run.private = {"noise_multiplier": sigma, "noise_std": std, "examples": len(run.train)}
    return seed


def _metrics(run: _Run, history: dict[str, list]) -> dict[str, Any]:
    """The contracts' keys first (docs/contracts.md), then the rest of the configuration and the outputs."""
    cfg = run.config
    metrics = {
        "method": cfg.method,
        "q": cfg.q,
        "batch_size": cfg.batch_size,
        "examples_per_query": cfg.batch_size // cfg.q,
        "steps": cfg.steps,
        "lr": cfg.lr,
        "lr_schedule": cfg.lr_schedule,
        "warmup_steps": cfg.warmup_steps,
        "lr_floor": cfg.lr_floor,
        "eps": cfg.eps,
        "seed": cfg.seed,
        "parallel": cfg.parallel if cfg.method == "mobizo" else None,
        "objective": run.objective,
        "losses": history["losses"],  # per step: the mean of that step's path losses
        "step_time_s": statistics.median(history["times"]),
        "train_time_s": sum(history["times"]),  # steps only (no evaluation, no batch building)
        "peak_rss_mb": peak_rss_mb(),
        "eval": history["eval"],
        "privacy": None if run.private is None else _privacy_metrics(run),
    }
    rest = {k: v for k, v in asdict(cfg).items() if k not in metrics and k not in ("train", "eval", "targets")}
    metrics |= rest | {
        "model": str(cfg.model),
        "out": str(cfg.out),
        "train_file": str(cfg.train),
        "eval_file": None if cfg.eval is None else str(cfg.eval),
        "targets": list(cfg.targets),
        "device": str(run.step.device),
        "n_train": len(run.train),
        "adapter": None if run.lora is None else ADAPTER_DIR,
        "train_log": LOG_FILE if history["log"] else None,
        "prior": None if run.prior is None else list(run.prior),  # log p_cf per candidate (shared.calibration)
    }
    if run.step.device.type == "cuda":
        metrics["peak_cuda_mb"] = torch.cuda.max_memory_allocated(run.step.device) / 2**20
    if run.lora is None:
        metrics["note"] = "mezo trains all parameters: no adapter is written (metrics only)"
    return metrics


def _privacy_metrics(run: _Run) -> dict[str, Any]:
    """What a private run spent: the accountant's epsilon at its delta for the steps it ran, and its parameters."""
    cfg, private = run.config, run.private
    spent = privacy.epsilon_spent(
        private["noise_multiplier"], cfg.dp_delta, cfg.steps, cfg.batch_size, private["examples"]
    )
    return {
        "epsilon": spent,
        "delta": cfg.dp_delta,
        "target_epsilon": cfg.dp_epsilon,
        "clip": cfg.dp_clip,
        "noise_multiplier": private["noise_multiplier"],
        "noise_std": private["noise_std"],
        "sampling": f"{cfg.batch_size} of {private['examples']} examples a step, without replacement",
    }


def _write_outputs(run: _Run, history: dict[str, list], metrics: dict[str, Any]) -> None:
    """Adapter and log first, metrics.json last: its presence means the run finished. Stale outputs go."""
    out = Path(run.config.out)
    out.mkdir(parents=True, exist_ok=True)
    if run.lora is not None:
        from shared.adapter import make_card
        from shared.model_files import model_sha256

        config, model = run.config, Path(run.config.model)
        prompt = (config.template, config.verbalizer, config.chat_template, run.objective, run.prior)
        card = make_card(config.task, *prompt, method=config.method, steps=config.steps, dp_epsilon=config.dp_epsilon)
        save_lora(out / ADAPTER_DIR, run.lora, run.step.b.cpu(), str(model), model_sha256(model), card)
    elif (out / ADAPTER_DIR).is_dir():
        shutil.rmtree(out / ADAPTER_DIR)  # an earlier run's adapter would pass for this run's
    if history["log"]:
        atomic_write_bytes(out / LOG_FILE, "".join(map(log_line, history["log"])).encode())
    else:
        (out / LOG_FILE).unlink(missing_ok=True)
    atomic_write_bytes(out / METRICS_FILE, (json.dumps(metrics, indent=2) + "\n").encode())


def train(config: TrainConfig, progress: bool = True, step_factory: StepFactory | None = None) -> dict[str, Any]:
    """Validate, train, write OUT/metrics.json (+ adapter, + log) and return the metrics. ``step_factory``: the
    step taken by something else than the eager ``MethodStep`` (``StepFactory``)."""
    config = with_defaults(config)
    task = validate(config)
    run = _prepare(config, task, step_factory)
    state = _loop(run, progress)
    metrics = _metrics(run, state.history) | {"best_eval": state.best}
    _write_outputs(run, state.history, metrics)
    return metrics
