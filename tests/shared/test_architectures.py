"""The paper's architectures by name, with random weights (shared/architectures.py)."""

from __future__ import annotations

import pytest
import torch

from shared.architectures import arch_config, random_model
from shared.errors import UsageError
from shared.hf_models import count_params

# --- named architectures ------------------------------------------------------------------------------------

# (hidden, layers, heads, kv heads, intermediate, vocab, tied) from each model's public config.json, and the
# published parameter counts (TinyLlama 1,100,048,384; Llama-2-7B 6,738,415,616; SmolLM2-135M 134,515,008).
ARCH_TABLE = [
    ("tinyllama-1.1b", (2048, 22, 32, 4, 5632, 32000, False), 1_100_048_384),
    ("llama2-7b", (4096, 32, 32, 32, 11008, 32000, False), 6_738_415_616),
    ("smollm2-135m", (576, 30, 9, 3, 1536, 49152, True), 134_515_008),
]


@pytest.mark.parametrize(("name", "shape", "n_params"), ARCH_TABLE)
def test_arch_config_matches_the_real_models(name: str, shape: tuple, n_params: int) -> None:
    c = arch_config(name)
    got = (
        c.hidden_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.intermediate_size,
        c.vocab_size,
        c.tie_word_embeddings,
    )
    assert got == shape
    assert count_params(random_model(name, seed=0, device="meta")) == n_params


def test_arch_config_rejects_unknown_names() -> None:
    with pytest.raises(UsageError, match="unknown architecture"):
        arch_config("gpt-5")


def test_random_model_is_seeded() -> None:
    a, b, c = (random_model("smollm2-135m", seed=s, dtype="bfloat16") for s in (0, 0, 1))
    weight = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(a.get_parameter(weight), b.get_parameter(weight), rtol=0, atol=0)
    assert not torch.equal(a.get_parameter(weight), c.get_parameter(weight))
    assert a.lm_head.weight is a.model.embed_tokens.weight  # tied as in the real model
    assert not a.training and not any(p.requires_grad for p in a.parameters())
    logits = a(torch.tensor([[1, 2, 3]])).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


# --- make-random-model ----------------------------------------------------------------------------------------

SMALL_ARCH = {  # a named architecture at test size: the command is the same for TinyLlama-1.1B
    "vocab_size": 700,
    "hidden_size": 32,
    "intermediate_size": 88,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def test_make_random_model_writes_a_seeded_model_with_a_tokenizer_of_the_vocabulary_size(tmp_path, monkeypatch):
    from mobizo.cli import main
    from shared import architectures
    from shared.hf_models import load_model

    monkeypatch.setitem(architectures.ARCHS, "small-test", SMALL_ARCH)
    for folder in ("a", "b"):
        assert main(["make-random-model", "--arch", "small-test", "--seed", "3", "--out", str(tmp_path / folder)]) == 0
    model, tokenizer = load_model(tmp_path / "a")
    assert model.config.vocab_size == len(tokenizer) == 700 and model.config.hidden_size == 32
    assert tokenizer("It was great").input_ids[0] == 1  # BOS first, as Llama tokenizers do
    for name in ("model.safetensors", "tokenizer.json"):  # the same seed, the same bytes
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert main(["make-random-model", "--arch", "nope", "--out", str(tmp_path / "c")]) == 2
