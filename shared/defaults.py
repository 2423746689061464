"""Training hyperparameter defaults: the one home of the values a job spec (``shared.schemas.HyperParams``),
``mobizo train`` (``shared.train.TrainConfig``), ``mobizo export`` and a program's config
(``shared.manifest.ProgramConfig``) fall back to when a value is not given.

Torch-free, so the REST schemas read them without loading the algorithm.

The learning rate, its schedule, the perturbation scale, the number of steps and the LoRA rank depend on the
method and the objective, so they are per method and objective (``for_method``; ``TUNED``); alpha follows the rank
(``alpha_for``). They are the values that ``benchmarks/accuracy.py`` showed to LEARN on a real model
(SmolLM2-135M-Instruct, SST-2, batch 16; docs/benchmarks/accuracy.md): there the MobiZO q=4
pilots at eps 1e-2 lowered the held-out loss from 8.17 to 6.12 nats in 50 steps at lr 3e-3 and to 7.36 at lr 1e-3,
so 3e-3 won (issue 12 saw 1e-3 go on falling to 4.8 nats by step 300), while the former default lr 1e-4 over 100
steps left the adapter close to zero. MeZO-LoRA is MobiZO q=1's mathematics, so it shares the learning rate.
First-order SGD on B learned at lr 1e-3 in 100 steps (issue 12). MeZO on all parameters keeps the paper's lr 1e-6,
eps 1e-3 (not measured here).

A program with 4-bit weights and int8 dynamic activations (``quantize`` 8da4w) needs a larger eps: its activation
quantization moves the loss by about as much as ±1e-2·z does, so g is mostly that noise. Measured through the
program (SmolLM2, SST-2, 200 steps at batch 1, lr 3e-3; docs/benchmarks/quantization.md): at eps 1e-2 the
held-out loss ROSE from 7.53 to 9.66 nats, at eps 1e-1 it fell to 4.10. So ZO LoRA methods default to eps 1e-1
there (``QUANTIZED_EPS``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

METHOD = "mobizo"
# Queries per step: 4 of E = 4 examples at the default batch of 16. Through the program at the classification
# defaults (SmolLM2-135M-Instruct, SST-2, 200 steps; docs/benchmarks/accuracy.md, "q at a fixed batch"): q 4 took
# test accuracy to 0.736 where q 1 (MeZO-LoRA's mathematics) reached 0.679, at the same cost per step; q 8 and 16
# gained no more than half a point over q 4 across three run seeds (docs/benchmarks/sweep.md). A batch that 4 does
# not divide needs its own --q. The other methods take one query (``q_for``).
Q = 4
BATCH_SIZE = 16
# Batches per length bucket (``shared.data.batch_indices``): each window of 8 batches is sorted by length and dealt
# out, so a batch pads little. A program runs a batch at its longest row: through the program on SmolLM2, SST-2 with
# its chosen prompt (2-core x86-64 VM; docs/benchmarks/sweep.md), a default step took 0.86 s instead of 2.07 s for
# the same accuracy (0.819 against 0.818 at step 200, run seed 0).
BUCKET = 8
RANK = 16
SCALING = 2.0  # alpha / rank where alpha is not given (alpha_for)
ALPHA = SCALING * RANK
TARGETS: tuple[str, ...] = ("q_proj", "v_proj")
SEED = 0
A_SEED = 0  # seeds the frozen LoRA A, independent of the run seed
EVAL_EXAMPLES = 100  # a job's held-out slice of the device's data (at most a fifth of it), measured before and after
SEQ_LEN = 64  # a job's program length (``mobizo train`` pads each batch to its longest row instead)
PROGRAM_BACKEND = "xnnpack"
PARALLEL = "both"  # a mobizo step's schedule: all 2q paths in one pass
QUANTIZE = "none"  # a program's frozen base linears (``shared.quantize``)
GROUP_SIZE = 32  # weights per scale of a 4-bit base linear; XNNPACK takes multiples of 32
# The learning-rate schedule over a run's steps (``shared.schedule``): its shape, its linear warm-up in steps and the
# floor it decays to, as a fraction of lr. Constant until a benchmark shows a decay that learns better.
LR_SCHEDULE = "constant"
WARMUP_STEPS = 0
LR_FLOOR = 0.0

SOURCE = "benchmarks/accuracy.py on SmolLM2-135M-Instruct, SST-2 (docs/benchmarks/accuracy.md)"


@dataclass(frozen=True)
class MethodDefaults:
    """What a run of one method uses for what it is not told (``TUNED``; alpha follows the rank: ``alpha_for``)."""

    lr: float
    eps: float
    steps: int
    rank: int = RANK
    lr_schedule: str = LR_SCHEDULE


# The hyperparameters a run takes from ``for_method`` when it does not give them: what the benchmark tuned.
TUNED = ("steps", "lr", "eps", "rank", "lr_schedule")


def alpha_for(rank: int) -> float:
    """LoRA alpha where it is not given: the scaling alpha / rank stays ``SCALING`` whatever the rank, so a rank
    chosen alone does not also change the size of the adapter's update."""
    return SCALING * rank


PER_METHOD: dict[str, MethodDefaults] = {
    "mobizo": MethodDefaults(lr=3e-3, eps=1e-2, steps=300),
    "mezo-lora": MethodDefaults(lr=3e-3, eps=1e-2, steps=300),
    "fo-lora": MethodDefaults(lr=1e-3, eps=1e-2, steps=100),  # eps unused: backprop
    "mezo": MethodDefaults(lr=1e-6, eps=1e-3, steps=300),
}


QUANTIZED_EPS: dict[str, float] = {"8da4w": 1e-1}  # eps of the ZO LoRA methods on a quantized program (above)
ZO_LORA_METHODS = ("mobizo", "mezo-lora")  # the methods a quantized program runs whose g depends on eps

# The classification objective (cross-entropy over the task's candidates; ``shared.zo.example_losses``) measures the
# decision alone, so it takes a larger step than the whole-vocabulary loss. Measured on SmolLM2-135M-Instruct, SST-2
# (1,000 training examples, MobiZO q 4, batch 16, eps 1e-2, 200 validation rows, test = the 872 dev sentences,
# zero-shot 0.516; docs/benchmarks/accuracy.md): at rank 16 lr 1e-2 constant gains +17.3 test points in 200 steps
# (lr 3e-2 diverged; a constant lr peaks at step 100 and falls back). Fewer coordinates take a larger step: rank 4
# (alpha 8) learns at lr 4e-2 (the best of 1e-2, 2e-2, 4e-2), and a cosine decay to 0 keeps the gain: +22.0.
# Over run seeds 0-2 rank 4 at lr 4e-2 gains +19.8 on average in 200 steps, and none of 15 variants around it (the lr,
# rank 1 and 2, v_proj alone, q 8 and 16, batch 32, eps 1e-3, a warm-up, momentum, the normalized update) gains
# more than half a point over that (benchmarks/sweep.py, docs/benchmarks/sweep.md). With the prompt chosen for the
# model (shared.prompts; SmolLM2 starts at 0.784 there, not at chance) the loss is lower and lr 4e-2 only hovers
# (0.788 at step 200, seed 0, through the program), where half of it, the default, learns: 0.818 (seed 0), and with
# length buckets (``BUCKET``) 0.819, 0.797 and 0.799 over run seeds 0-2 (mean 0.805, +2.1; docs/benchmarks/sweep.md).
# Over 2,000 steps on the built-in prompt lr 4e-2 peaks at step 500 and falls back (test +15.3) and 2e-2 gains +28.3
# (0.799): the same lr.
CLASSIFICATION = MethodDefaults(lr=2e-2, eps=1e-2, steps=200, rank=4, lr_schedule="cosine")


def q_for(method: str) -> int:
    """Queries per step where none is given: ``Q`` for a mobizo run, 1 for the methods that estimate (or compute) one
    gradient a step (MeZO-LoRA, MeZO, first-order)."""
    return Q if method == METHOD else 1


def default_objective(task_kind: str, answer_len: int | None = None) -> str:
    """A job's objective when it names none: ``classification`` for a classification task (unless it fixes answers
    longer than one token), else ``lm``. The model's tokenizer then checks that the answers are single tokens
    (``shared.data.resolve_objective``), refusing the job, naming ``objective``, when they are not."""
    return "classification" if task_kind == "classification" and answer_len in (None, 1) else "lm"


def for_method(method: str, quantize: str = QUANTIZE, objective: str | None = None) -> MethodDefaults:
    """The defaults of ``method`` on a program whose base weights are ``quantize``, training ``objective`` (an
    unknown method gets MobiZO's: it is refused later, naming the flag). A private run takes the same: its clip
    (``DP_CLIP``) keeps the step's signal."""
    chosen = PER_METHOD.get(method, PER_METHOD[METHOD])
    if objective == "classification" and method in ZO_LORA_METHODS:
        chosen = CLASSIFICATION
    if quantize in QUANTIZED_EPS and method in ZO_LORA_METHODS:
        return replace(chosen, eps=QUANTIZED_EPS[quantize])
    return chosen


def describe() -> str:
    """One line per method for --help texts: where the values come from and what they are."""
    rows = "; ".join(f"{m}: {_describe(d)}" for m, d in PER_METHOD.items())
    quantized = ", ".join(f"--quantize {q}: eps {eps:g}" for q, eps in QUANTIZED_EPS.items())
    return (
        f"objective lm: {rows} (from {SOURCE}); objective classification (the default for classification tasks): "
        f"{' and '.join(ZO_LORA_METHODS)} {_describe(CLASSIFICATION)}, length buckets of {BUCKET} batches "
        f"(SmolLM2, SST-2 with its chosen prompt: 0.784 -> 0.805 test accuracy in 200 steps, 170 device-seconds, "
        f"mean of 3 run seeds; "
        f"docs/benchmarks/sweep.md); {quantized} for "
        f"{' and '.join(ZO_LORA_METHODS)}; alpha: {SCALING:g} x rank"
    )


def _describe(d: MethodDefaults) -> str:
    return f"lr {d.lr:g} {d.lr_schedule}, eps {d.eps:g}, {d.steps} steps, rank {d.rank}"


MAX_CONTEXT = 512  # an inference program's KV cache, in positions (prompt + generated tokens)
MAX_CONTEXT_LIMIT = 4096  # the largest a server compiles: the cache costs 2 x layers x kv-heads x head-dim x 4 B each

# Private jobs (shared.privacy): the delta of a target (epsilon, delta) when none is given, DP-ZO's, and the clip C
# of each example's projected difference. C = 4 keeps a step's signal where C = 1 cut it to a third (the median |g|
# of a clipped run without noise: 0.32 at C = 4, 0.13 at C = 1, 0.35 unclipped), and the larger noise it takes
# costs less than that: SmolLM2, SST-2, 200 steps at the method's own lr, 872 validation rows
# (benchmarks/privacy.py, docs/benchmarks/privacy.md): 0.679, 0.673 and 0.669 at epsilon 8 (three draws), 0.696 and
# 0.685 at 3, 0.565 and 0.562 at 1, against 0.719 not private; C = 1 ended at 0.603 at epsilon 8, even at twice the lr.
DP_DELTA = 1e-5
DP_CLIP = 4.0
