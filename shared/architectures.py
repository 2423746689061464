"""The paper's model architectures by name (public ``config.json`` shapes, no weights), built with random
weights for timing and memory at real scales (``benchmarks/``) or written as model folders (``make_random_model``)."""

from __future__ import annotations

from pathlib import Path

from transformers import LlamaConfig, PreTrainedModel

from shared.errors import MobizoError, UsageError
from shared.hf_models import build_random, resolve_dtype, save_model

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


def arch_config(name: str) -> LlamaConfig:
    """A fresh LlamaConfig of a named architecture (see ``ARCHS``)."""
    if name not in ARCHS:
        raise UsageError("arch", f"unknown architecture {name!r} (choose from {', '.join(ARCHS)})")
    return LlamaConfig(**ARCHS[name])


def random_model(arch: str, seed: int, dtype: str = "float32", device: str = "cpu") -> PreTrainedModel:
    """A randomly initialised model of a named architecture, for timing and memory at the paper's scales.

    Weights depend on the seed and the device type (CPU and CUDA generators differ).
    """
    return build_random(arch_config(arch), seed, resolve_dtype(dtype), device)


def make_random_model(arch: str, out_dir: Path, seed: int = 0, dtype: str = "float32") -> Path:
    """Write a seeded random-init model of a named architecture as a Hugging Face folder, with a seeded byte-level
    BPE tokenizer of the architecture's vocabulary size (``mobizo make-random-model``): 1B-class exports and
    benchmarks where nothing can be downloaded. Weights depend on the seed alone (CPU generator)."""
    from shared.tiny_model import train_tokenizer

    config = arch_config(arch)
    tokenizer = train_tokenizer(config.vocab_size, seed=seed)
    if len(tokenizer) != config.vocab_size:
        raise MobizoError(f"the tokenizer reached {len(tokenizer)} tokens, not the {config.vocab_size} of {arch}")
    return save_model(out_dir, random_model(arch, seed, dtype), tokenizer)
