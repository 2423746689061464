"""The seeded tiny Llama for demos and tests (``mobizo make-tiny-model``), with a byte-level BPE tokenizer trained
on a fixed slice of the task data, since nothing can be downloaded."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch
from transformers import LlamaConfig, PreTrainedTokenizerFast

from shared.errors import DataError, MobizoError, UsageError
from shared.hf_models import build_random, save_model
from shared.tasks import TASK_DATA_ENV, task_data_dir

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


def corpus_files() -> tuple[Path, ...]:
    """The data files the tiny tokenizer is trained from (a change to them changes the model's files)."""
    return tuple(task_data_dir() / file for file, _, _ in _CORPUS)


def make_tiny_model(out_dir: Path, seed: int = 0, layers: int = 2, hidden: int = 64, vocab: int = 512) -> Path:
    """Write a seeded tiny LlamaForCausalLM and its tokenizer to ``out_dir`` in Hugging Face layout.

    The same arguments give byte-identical files on one machine, so tests and demos can pin numbers on it. Across
    machines the weights may differ in their last bits: torch's vectorized ``normal_`` (AVX2, AVX-512) rounds
    differently from its portable kernel.
    """
    _check_tiny_args(layers, hidden, vocab)
    tokenizer = train_tokenizer(vocab)
    model = build_random(_tiny_config(layers, hidden, vocab), seed, torch.float32, "cpu")
    return save_model(out_dir, model, tokenizer)


def _check_tiny_args(layers: int, hidden: int, vocab: int) -> None:
    if layers < 1:
        raise UsageError("layers", f"must be at least 1, got {layers}")
    if hidden < 2 * TINY_HEADS or hidden % (2 * TINY_HEADS):
        # each of the 4 heads needs an even size for the rotary embedding
        raise UsageError("hidden", f"must be a positive multiple of {2 * TINY_HEADS}, got {hidden}")
    if vocab < MIN_TINY_VOCAB:
        raise UsageError("vocab", f"must be at least {MIN_TINY_VOCAB} (256 bytes + special tokens), got {vocab}")


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


def train_tokenizer(vocab: int, seed: int | None = None) -> PreTrainedTokenizerFast:
    """Byte-level BPE (any text encodes), adding BOS in front of every sequence as Llama tokenizers do.

    With ``seed``, seeded random words join the task text, so that the large vocabularies of the paper's
    architectures (32,000 or 49,152 tokens, ``mobizo make-random-model``) fill up; the same seed, the same tokenizer.
    """
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
    tok.train_from_iterator(_tokenizer_corpus() + ([] if seed is None else _random_words(seed)), trainer)
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
    data = task_data_dir()
    missing = [name for name, _, _ in _CORPUS if not (data / name).is_file()]
    if missing:
        raise MobizoError(
            f"the tiny model's tokenizer is trained on the task data, and {data} lacks {', '.join(missing)} "
            f"(the repository's data/ samples, or the folder ${TASK_DATA_ENV} names)"
        )
    for name, fields, n_lines in _CORPUS:
        texts.extend(_read_fields(data / name, fields, n_lines))
    return texts


def _random_words(seed: int, count: int = 120_000, per_line: int = 32) -> list[str]:
    """Lines of seeded random lower-case words (3 to 10 letters): enough distinct letter pairs for about 10**5
    BPE merges, which the task text alone does not have."""
    import numpy as np

    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, size=int(n))) for n in rng.integers(3, 11, size=count)]
    return [" ".join(words[i : i + per_line]) for i in range(0, count, per_line)]


def _read_fields(path: Path, fields: tuple[str, ...], n_lines: int) -> list[str]:
    """The fields of the first ``n_lines`` lines; a shorter file is refused (it would train another tokenizer)."""
    texts: list[str] = []
    lineno = 0
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(itertools.islice(fh, n_lines), start=1):
            try:
                row = json.loads(line)
                texts.extend(str(row[field]) for field in fields)
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise DataError(f"{path}:{lineno}: {exc}") from exc
    if lineno < n_lines:
        raise MobizoError(
            f"the tiny model's tokenizer is trained on the first {n_lines} lines of {path}, which has {lineno}"
        )
    return texts
