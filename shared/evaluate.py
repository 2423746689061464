"""Accuracy and loss of a causal LM on a task, by scoring candidate answers with the model's likelihood.

Each (example, candidate) pair is one row of a left-padded batch (``shared.data.training_batch``), so one forward
pass scores a whole chunk of pairs. A candidate's score is the mean log-likelihood of its tokens given the prompt,
which does not favour short answers the way a sum would; the prediction is the best-scoring candidate. The loss
is the training loss: cross-entropy over the whole vocabulary, averaged over the tokens of the correct answers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from shared.batch import IGNORE_INDEX
from shared.data import Encoded, encode, pad_token_id, training_batch
from shared.tasks import Rendered, Task


def _answer_nll(
    model: Any, rows: list[Encoded], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed negative log-likelihood of each row's answer tokens, and how many tokens that is (CPU tensors)."""
    batch = training_batch(rows, pad_id)
    targets = batch.targets.to(device)
    logits = model(
        input_ids=batch.input_ids.to(device),
        attention_mask=batch.attention_mask.to(device),
        position_ids=batch.position_ids.to(device),
        logits_to_keep=targets.shape[1] + 1,
    ).logits[:, :-1]
    nll = F.cross_entropy(logits.float().transpose(1, 2), targets, ignore_index=IGNORE_INDEX, reduction="none")
    return nll.sum(dim=1).cpu(), (targets != IGNORE_INDEX).sum(dim=1).cpu()


def _pairs(encoded: list[Encoded]) -> list[tuple[int, int]]:
    """(example, candidate) pairs, shortest rows first so that each chunk pads little."""
    pairs = [(i, c) for i, e in enumerate(encoded) for c in range(len(e.candidate_ids))]
    return sorted(pairs, key=lambda p: len(encoded[p[0]].prompt_ids) + len(encoded[p[0]].candidate_ids[p[1]]))


def _score_all(
    model: Any, encoded: list[Encoded], pad_id: int, batch_size: int, progress: bool
) -> tuple[list[list[float]], list[list[int]]]:
    """Summed NLL and token count for every candidate of every example: ``[example][candidate]``."""
    device = next(model.parameters()).device
    nll = [[0.0] * len(e.candidate_ids) for e in encoded]
    count = [[0] * len(e.candidate_ids) for e in encoded]
    pairs = _pairs(encoded)
    chunks = range(0, len(pairs), batch_size)
    for start in tqdm(chunks, desc="eval", unit="batch", disable=not progress):
        chunk = pairs[start : start + batch_size]
        rows = [Encoded(encoded[i].prompt_ids, [encoded[i].candidate_ids[c]], 0) for i, c in chunk]
        sums, counts = _answer_nll(model, rows, pad_id, device)
        for (i, c), s, n in zip(chunk, sums.tolist(), counts.tolist(), strict=True):
            nll[i][c], count[i][c] = s, n
    return nll, count


def evaluate(
    model: Any,
    tokenizer: Any,
    task: Task,
    rendered: list[Rendered],
    batch_size: int = 16,
    max_len: int | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """``{"accuracy", "loss", "n"}`` of ``model`` on the rendered examples (accuracy is None for ``lm`` tasks).

    ``batch_size`` counts (example, candidate) rows per forward pass; ``max_len`` truncates prompts as
    ``shared.data.encode`` does. The model runs in eval mode under ``no_grad`` and gets its mode back after.
    """
    if not rendered:
        raise ValueError("evaluate needs at least one example")
    encoded = encode(rendered, tokenizer, max_len)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            nll, count = _score_all(model, encoded, pad_token_id(tokenizer), batch_size, progress)
    finally:
        model.train(was_training)
    labels = [e.label for e in encoded]
    loss = sum(row[y] for row, y in zip(nll, labels)) / sum(row[y] for row, y in zip(count, labels))
    accuracy = None
    if task.kind != "lm":
        hits = [_best(row_nll, row_count) == y for row_nll, row_count, y in zip(nll, count, labels, strict=True)]
        accuracy = sum(hits) / len(hits)
    return {"accuracy": accuracy, "loss": loss, "n": len(encoded)}


def _best(nll: list[float], count: list[int]) -> int:
    """The candidate with the highest mean log-likelihood (the first one on a tie)."""
    return max(range(len(nll)), key=lambda c: -nll[c] / count[c])
