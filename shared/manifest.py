"""The program contract, without torch: a program's config and the manifest written beside every ``.pte``.

``ProgramConfig`` fixes a program's graph (shapes and LoRA layout) and checks itself; ``ProgramManifest`` is the
``FILE.json`` that ``shared.program.export_program`` writes next to ``FILE.pte``: the config, the methods, the
LoRA layout of the flat B, the files with their sha256, and the memory estimate. The server stores it, hands it to
devices in their lease (``shared.schemas.LeasePublic``), and the agent, the replay and the adapter writer read it.
The JSON on disk and over REST is the one docs/contracts.md describes; these models only type it.

Two more kinds of program have their own manifest: the inference program (``InferenceManifest``) and the
first-order peer of the training step (``FirstOrderManifest``, ``shared.fo_program``), which a benchmark runs and no
job does. A training manifest's ``kind`` tells the two training kinds apart; a zeroth-order manifest has none.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal, Self, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from shared import defaults
from shared.backends import Objective, Optimizer, Parallel, ProbeWeights, ProgramBackend, Quantization
from shared.errors import FieldError
from shared.text_fields import Line

# 2: the .pte carries no B; the device sets it before step 1. 3: forward and evaluate take any number of columns in
# ``ProgramInputs.widths`` (a batch runs at its longest row, not at seq_len).
FORMAT_VERSION = 3
ProgramMethod = Literal["forward", "get_lora_b", "set_lora_b", "evaluate", "get_opt_state", "set_opt_state"]
PROGRAM_METHODS: tuple[str, ...] = get_args(ProgramMethod)[:4]  # every program has these
STATE_METHODS: tuple[str, ...] = get_args(ProgramMethod)[4:]  # and a program whose optimizer keeps a state, these
# The kinds of training program: the job's step (whose manifest carries no ``kind``) and its first-order peer.
ProgramKind = Literal["zeroth-order", "first-order"]
ZEROTH_ORDER, FIRST_ORDER = get_args(ProgramKind)


def examples_per_query(batch_size: int, q: int) -> int:
    """E = batch_size / q, each query's examples; ``FieldError`` naming ``batch_size`` when q does not divide it."""
    if batch_size % q:
        raise FieldError("batch_size", f"{batch_size} is not divisible by q={q}")
    return batch_size // q


def check_prompt_room(seq_len: int, answer_len: int) -> None:
    """A row of ``seq_len`` tokens must hold at least one prompt token before ``answer_len`` answer tokens."""
    if answer_len >= seq_len:
        raise FieldError("seq_len", f"{seq_len} leaves no room for a prompt and {answer_len} answer tokens")


class ProgramConfig(BaseModel):
    """Everything that fixes a program's graph (shapes and LoRA layout); not the user's data or B."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    q: int = Field(ge=1)
    batch_size: int = Field(ge=1)
    seq_len: int = Field(ge=2)
    answer_len: int = Field(ge=1)
    rank: int = Field(default=defaults.RANK, ge=1)
    alpha: float = Field(default=defaults.ALPHA, gt=0)
    targets: tuple[str, ...] = Field(default=defaults.TARGETS, min_length=1)
    a_seed: int = Field(default=defaults.A_SEED, ge=0)
    backend: ProgramBackend = defaults.PROGRAM_BACKEND
    parallel: Parallel = defaults.PARALLEL
    quantize: Quantization = defaults.QUANTIZE
    group_size: int = Field(default=defaults.GROUP_SIZE, ge=32, multiple_of=32)
    # Not the graph but how the device frames its prompts: the model's chat template around one user message
    # (``shared.tasks.chat_frame``), or None for plain prompts. In the config so that a program built for chat
    # prompts is never served to a job without them (its answer length may differ).
    chat: tuple[str, str] | None = None
    # What the step's loss measures (``shared.zo.example_losses``): ``lm``, or ``classification`` over the task's
    # single-token candidates, whose ids the program holds (so a program serves one verbalizer of one tokenizer).
    objective: Objective = "lm"
    candidates: tuple[int, ...] = ()
    # A calibrated classification objective: the prompt's content-free prior per candidate (float32 values,
    # ``shared.calibration``), subtracted from the candidates' scores in the loss and in a device's evaluation.
    # Left out of the JSON when empty (uncalibrated): earlier configs, keys and manifests stay what they were.
    prior: tuple[float, ...] = ()
    # A private program's ``forward`` takes two more inputs, the clip C [1] and the step's noise of its g's [q]
    # (``shared.privacy``): g from each example's clipped difference, plus that noise.
    private: bool = False
    # How g moves B inside ``forward`` (``shared.zo_optim``); a program of another optimizer than ``sgd`` holds its
    # state in a buffer beside B. Left out of the JSON when ``sgd``: the configs, keys and manifests of programs
    # made before there were optimizers stay what they were.
    optimizer: Optimizer = "sgd"
    # ``curvature``: ``forward`` runs a clean path beside each query's pair (losses [3q]) and weighs each g by its
    # probe's curvature (``shared.zo``). Left out of the JSON when ``none``, as ``optimizer`` is when ``sgd``.
    probe_weights: ProbeWeights = "none"

    @model_serializer(mode="wrap")
    def _sgd_unsaid(self, handler):
        data = handler(self)
        if self.optimizer == "sgd":
            data.pop("optimizer", None)
        if self.probe_weights == "none":
            data.pop("probe_weights", None)
        if not self.prior:
            data.pop("prior", None)
        return data

    @property
    def methods(self) -> list[str]:
        """The methods of its program: ``PROGRAM_METHODS``, and ``STATE_METHODS`` when the optimizer keeps a state."""
        return [*PROGRAM_METHODS, *(STATE_METHODS if self.optimizer != "sgd" else ())]

    @model_validator(mode="after")
    def _consistent(self) -> ProgramConfig:
        examples_per_query(self.batch_size, self.q)
        check_prompt_room(self.seq_len, self.answer_len)
        if self.objective == "classification":
            if len(self.candidates) < 2 or self.answer_len != 1 or min(self.candidates) < 0:
                raise FieldError("objective", "classification needs two or more single-token candidates (answer_len 1)")
        elif self.candidates:
            raise FieldError("candidates", "only the classification objective scores candidates")
        if self.prior and (len(self.prior) != len(self.candidates) or not all(map(math.isfinite, self.prior))):
            raise FieldError("prior", "a calibrated classification program has one finite prior per candidate")
        if self.probe_weights != "none" and (self.private or self.parallel != "both"):
            raise FieldError("probe_weights", "curvature weights take a step that is not private, of parallel both")
        return self

    @property
    def examples_per_query(self) -> int:
        return self.batch_size // self.q

    @property
    def widths(self) -> tuple[int, int] | None:
        """The columns ``forward`` and ``evaluate`` take, from the narrowest to ``seq_len``: a batch runs at its longest
        row, so its padding costs nothing. At least an answer, a prompt token and 3 columns (``torch.export``
        specializes sizes below that); None where ``seq_len`` leaves no range (the program then has one width)."""
        low = max(self.answer_len + 1, 3)
        return (low, self.seq_len) if low < self.seq_len else None

    @classmethod
    def from_spec(
        cls,
        spec: Any,
        answer_len: int,
        chat: tuple[str, str] | None = None,
        objective: str = "lm",
        candidates: tuple[int, ...] = (),
        prior: tuple[float, ...] = (),
    ) -> ProgramConfig:
        """The program of a job spec (``shared.schemas.HyperParams`` or its JSON) with ``answer_len``, the chat
        frame (for a spec with ``chat_template``) and the objective with its candidates resolved from the model
        (``shared.data.resolve_objective``), and a calibrated objective's prior (measured on the model)."""
        get = spec.get if isinstance(spec, dict) else lambda name: getattr(spec, name)
        return cls(
            q=get("q"),
            batch_size=get("batch_size"),
            seq_len=get("seq_len"),
            answer_len=answer_len,
            rank=get("rank"),
            alpha=float(get("alpha")),
            targets=tuple(get("targets")),
            a_seed=get("a_seed"),
            backend=get("program_backend"),
            quantize=get("quantize") or defaults.QUANTIZE,  # specs stored before these fields have none
            group_size=get("group_size") or defaults.GROUP_SIZE,
            parallel=get("parallel") or defaults.PARALLEL,
            chat=chat,
            objective=objective,
            candidates=tuple(candidates),
            prior=tuple(prior),
            private=get("privacy") is not None,
            optimizer=get("optimizer") or "sgd",  # specs stored before there were optimizers have none
            probe_weights=get("probe_weights") or "none",
        )


class LoRAModule(BaseModel):
    """Where one module's B lives in the flat vector (``shared.lora``'s layout)."""

    model_config = ConfigDict(frozen=True)

    name: str
    in_features: int
    out_features: int
    offset: int

    def numel(self, rank: int) -> int:
        return self.out_features * rank


class ProgramFile(BaseModel):
    """A file of the program (``.pte``, shared ``.ptd``, tokenizer), named and checked by content."""

    file: str
    sha256: str
    size: int


class ProgramInputs(BaseModel):
    """The shapes of ``forward``'s inputs and how rows are padded."""

    forward: dict[str, list[int]]  # the largest shapes
    padding: str
    # [narrowest, widest] columns of input_ids and attention_mask (``ProgramConfig.widths``); absent: exactly the
    # shapes above (format 2)
    widths: tuple[int, int] | None = None


class _Manifest(BaseModel):
    """What every program's ``FILE.json`` does, training or inference: ``model``, the exporting machine's path of
    the base model, is left out of what devices get (the JSON then has no ``model`` key at all). Each subclass
    declares its own fields, ``model`` included: their order is the order of the file's keys
    (``docs/contracts.md``), and a field declared here would come first."""

    @model_serializer(mode="wrap")
    def _no_absent_model(self, handler):
        data = handler(self)
        if self.model is None:
            data.pop("model", None)
        return data

    def for_device(self) -> Self:
        """The manifest without the server's model path (none of a device's business)."""
        return self.model_copy(update={"model": None})

    def to_json(self) -> bytes:
        return json.dumps(self.model_dump(mode="json"), indent=2).encode()


class ProgramManifest(_Manifest):
    """``FILE.json`` beside a training ``FILE.pte``."""

    format: int
    model: str | None = None
    config: ProgramConfig
    methods: list[ProgramMethod]
    lora: list[LoRAModule]
    lora_size: int = Field(ge=0, description="D, the length of the flat B")
    inputs: ProgramInputs
    pte: ProgramFile
    ptd: ProgramFile
    tokenizer: ProgramFile
    init_b: ProgramFile | None = Field(
        default=None, description="the B file to set before step 1 (``export --adapter``); null: start from zeros"
    )
    memory_mb: int = Field(
        description="RAM a device needs to train with it: files, XNNPACK's packed weights and the memory plan "
        "(shared.program.memory_estimate_mb; an estimate for the lease filter)"
    )
    export_seconds: float

    @model_validator(mode="before")
    @classmethod
    def _zeroth_order(cls, data: Any) -> Any:
        """A manifest of another kind (its ``kind`` says which) is refused by name, not by its missing fields."""
        if isinstance(data, dict) and data.get("kind", ZEROTH_ORDER) != ZEROTH_ORDER:
            raise ValueError(f"the manifest of a {data['kind']} program, not of a {ZEROTH_ORDER} one")
        return data

    @field_validator("init_b", mode="before")
    @classmethod
    def _format_1_init_b(cls, value: Any) -> Any:
        """Format 1 wrote ``false`` for a program starting from zeros (every server-compiled one): still readable."""
        return None if value is False else value


def manifest_path(pte: Path) -> Path:
    return Path(pte).with_suffix(".json")


def init_b_path(pte: Path) -> Path:
    """Where ``export --adapter`` writes a program's starting B (a B file, ``shared.b_file``)."""
    return Path(pte).with_suffix(".init.safetensors")


def read_manifest(pte: Path) -> ProgramManifest:
    """The manifest beside the program ``pte``."""
    return ProgramManifest.model_validate_json(manifest_path(pte).read_bytes())


class FirstOrderManifest(_Manifest):
    """``FILE.json`` beside a first-order ``FILE.pte`` (``shared.fo_program``): ``forward(input_ids,
    attention_mask, targets) -> (loss,)`` exported forward and backward for ExecuTorch's training runtime, whose one
    parameter is the flat B (``lora_size`` floats, zeros in the program). ``config`` is the zeroth-order program's
    whose adapter, objective and shapes it takes; it runs ``config.batch_size`` rows of ``config.seq_len`` columns."""

    kind: Literal["first-order"]
    model: str | None = None
    config: ProgramConfig
    lora_size: int = Field(ge=0, description="D, the length of the flat B")
    pte: ProgramFile
    ptd: ProgramFile
    tokenizer: ProgramFile
    planned_bytes: dict[str, int] = Field(description="the memory plan's bytes per method (``lowering.Emitted``)")
    export_seconds: float


def read_first_order_manifest(pte: Path) -> FirstOrderManifest:
    """The manifest beside the first-order program ``pte``; ``ValidationError`` for another kind's."""
    return FirstOrderManifest.model_validate_json(manifest_path(pte).read_bytes())


def read_training_manifest(pte: Path) -> ProgramManifest | FirstOrderManifest:
    """The manifest beside a training program of either kind, read as its ``kind`` says (none: zeroth-order)."""
    data = json.loads(manifest_path(pte).read_bytes())
    kind = data.get("kind", ZEROTH_ORDER) if isinstance(data, dict) else ZEROTH_ORDER
    return (FirstOrderManifest if kind == FIRST_ORDER else ProgramManifest).model_validate(data)


INFERENCE_FORMAT_VERSION = 2  # 2: the KV cache is not stored; set_lora_b zeroes it and must precede forward
InferenceMethod = Literal["forward", "set_lora_b"]
INFERENCE_METHODS: tuple[str, ...] = get_args(InferenceMethod)


class InferenceConfig(BaseModel):
    """Everything that fixes an inference program's graph: its context and the LoRA layout, which must be the
    training programs' (rank, alpha, targets, A seed) for the two to share one weights ``.ptd``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_context: int = Field(default=defaults.MAX_CONTEXT, ge=2, le=defaults.MAX_CONTEXT_LIMIT)
    rank: int = Field(default=defaults.RANK, ge=1)
    alpha: float = Field(default=defaults.ALPHA, gt=0)
    targets: tuple[Line, ...] = Field(default=defaults.TARGETS, min_length=1)
    a_seed: int = Field(default=defaults.A_SEED, ge=0)
    backend: ProgramBackend = defaults.PROGRAM_BACKEND


class InferenceManifest(_Manifest):
    """``FILE.json`` beside an inference ``FILE.pte``: ``forward(tokens [1, T], input_pos [T]) -> logits [1, T, V]``
    with a KV cache of ``config.max_context`` positions inside the program, and ``set_lora_b(b [lora_size])``, which
    also empties the cache and is called once before the first ``forward``."""

    format: int
    model: str | None = None
    config: InferenceConfig
    methods: list[InferenceMethod]
    lora: list[LoRAModule]
    lora_size: int = Field(ge=0)
    vocab_size: int = Field(ge=1)
    stop_token_ids: list[int] = Field(description="ids that end a generation (the tokenizer's and model's EOS)")
    pte: ProgramFile
    ptd: ProgramFile
    tokenizer: ProgramFile
    export_seconds: float


def read_inference_manifest(pte: Path) -> InferenceManifest:
    """The manifest beside the inference program ``pte``."""
    return InferenceManifest.model_validate_json(manifest_path(pte).read_bytes())
