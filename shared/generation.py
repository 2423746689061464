"""Autoregressive generation, one home for both engines: sampling, the prefill/decode loop and its timings.

The loop knows nothing of the engine: it calls ``step(tokens [1, T], input_pos [T]) -> logits [V]`` (the logits
of the last position) once with the whole prompt (prefill), then once per new token (decode). Eager PyTorch with a
KV cache (``EagerStepper``, ``mobizo generate``) and the ExecuTorch inference program (``mobizo agent generate``)
are two such steps, so the same seed and sampling settings pick the same tokens from the same logits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from shared.errors import UsageError

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: temperature 0 is greedy (argmax, the first on a tie); else softmax(logits / T)
    restricted to the smallest set of tokens whose probability reaches ``top_p`` (nucleus), drawn with ``seed``."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise UsageError("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UsageError("top_p", f"must be in (0, 1], got {self.top_p}")


def sample_next(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """The next token id from the last position's logits [V]."""
    logits = logits.detach().to(torch.float64).reshape(-1)
    if sampling.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / sampling.temperature, dim=0)
    ordered, order = torch.sort(probs, descending=True, stable=True)
    # keep a token while the mass before it is below top_p: the most likely token is always kept
    keep = (torch.cumsum(ordered, dim=0) - ordered) < sampling.top_p
    kept = ordered * keep
    return int(order[torch.multinomial(kept / kept.sum(), 1, generator=generator)])


@dataclass(frozen=True)
class Generated:
    """One new token and the seconds its step took (the first one's includes the prompt's prefill)."""

    token: int
    seconds: float


def generate(
    step: Step,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: Sampling,
    stop_ids: frozenset[int] = frozenset(),
    max_context: int | None = None,
) -> Iterator[Generated]:
    """Yield new tokens as they are produced; stops after ``max_new_tokens``, at a stop token (yielded), or when
    the context (prompt + generated) would exceed ``max_context``."""
    if not prompt_ids:
        raise UsageError("prompt", "is empty after tokenization")
    if max_new_tokens < 1:
        raise UsageError("max_new_tokens", f"must be at least 1, got {max_new_tokens}")
    if max_context is not None and len(prompt_ids) >= max_context:
        raise UsageError("prompt", f"{len(prompt_ids)} tokens leave no room in a context of {max_context}")
    generator = torch.Generator().manual_seed(sampling.seed)
    tokens, position = list(prompt_ids), 0
    for _ in range(max_new_tokens):
        started = time.perf_counter()
        new = torch.tensor([tokens[position:]], dtype=torch.long)
        logits = step(new, torch.arange(position, len(tokens), dtype=torch.long))
        token = sample_next(logits, sampling, generator)
        yield Generated(token, time.perf_counter() - started)
        position = len(tokens)
        tokens.append(token)
        if token in stop_ids or (max_context is not None and len(tokens) >= max_context):
            return


class EagerStepper:
    """``Step`` for an eager Hugging Face model (plain or PEFT-wrapped) with a growing KV cache."""

    def __init__(self, model: torch.nn.Module) -> None:
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache()

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=tokens, position_ids=input_pos[None], past_key_values=self.cache, use_cache=True)
        return out.logits[0, -1]


class TextStream:
    """Decodes a growing list of token ids into the text still to print, holding back an incomplete character."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.printed = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # a multi-byte character split across tokens: wait for its rest
            return ""
        piece, self.printed = text[self.printed :], len(text)
        return piece


def stop_token_ids(tokenizer, generation_eos: int | list[int] | None = None) -> frozenset[int]:
    """The ids that end a generation: the tokenizer's EOS and the model's generation-config EOS id(s)."""
    ids = {tokenizer.eos_token_id}
    ids.update(generation_eos if isinstance(generation_eos, list) else [generation_eos])
    return frozenset(i for i in ids if i is not None)


def summary(prompt_tokens: int, steps: list[Generated]) -> dict:
    """Timings of a generation for ``--json`` and the benchmarks: the prefill (prompt + first token) and decode."""
    decode = [s.seconds for s in steps[1:]]
    decode_s = sum(decode)
    return {
        "prompt_tokens": prompt_tokens,
        "new_tokens": len(steps),
        "prefill_s": round(steps[0].seconds, 6) if steps else None,
        "prefill_tokens_per_s": round(prompt_tokens / steps[0].seconds, 2) if steps else None,
        "decode_step_ms": round(1000 * decode_s / len(decode), 3) if decode else None,
        "decode_tokens_per_s": round(len(decode) / decode_s, 2) if decode_s > 0 else None,
    }
