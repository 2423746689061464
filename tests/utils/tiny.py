"""Factories for tests: tiny random Llama-style models and left-padded batches, built in-process."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from shared.batch import IGNORE_INDEX, Batch
from shared.hf_models import ATTENTION

VOCAB = 96


def tiny_llama(seed: int = 0, layers: int = 2, hidden: int = 32, vocab: int = VOCAB, **config) -> LlamaForCausalLM:
    """A seeded random LlamaForCausalLM small enough for unit tests."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        **config,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.config._attn_implementation = ATTENTION
    model.requires_grad_(False)
    return model


def random_batch(
    rows: int, seed: int = 0, max_len: int = 12, answer_len: int = 1, vocab: int = VOCAB, candidates: tuple = ()
) -> Batch:
    """Rows of random lengths, left-padded with 0, the last ``answer_len`` tokens of each row as targets; with
    ``candidates`` (the classification objective) each row's answer is one of them, at random."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(answer_len + 2, max_len + 1, (rows,), generator=gen)
    ids = torch.zeros(rows, max_len, dtype=torch.long)
    mask = torch.zeros(rows, max_len, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        ids[i, max_len - n :] = torch.randint(1, vocab, (n,), generator=gen)
        mask[i, max_len - n :] = 1
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    if candidates:
        ids[:, -1] = torch.tensor(candidates)[torch.randint(0, len(candidates), (rows,), generator=gen)]
    targets = ids[:, max_len - answer_len :].clone()
    targets[mask[:, max_len - answer_len :] == 0] = IGNORE_INDEX
    return Batch(ids, mask, positions, targets, torch.tensor(candidates) if candidates else None)
