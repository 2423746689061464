"""Accuracy and loss on held-out data with the program's own ``evaluate`` method (master B, no perturbation).

Why the program and not PyTorch: a device has the ``.pte``, the ``.ptd`` and the tokenizer, not a model PyTorch
can run, and the program's ``evaluate`` gives exactly what accuracy needs. Each (example, candidate) pair is one
row; the method returns the row's mean cross-entropy over its answer tokens, i.e. minus the candidate's mean
log-likelihood, which is ``shared.evaluate``'s score. So the prediction (the candidate with the lowest mean loss,
the first on a tie) and the loss (token-weighted mean over the correct answers) are ``mobizo eval``'s, computed by
the device's kernels with the device's B. Rows have the program's fixed shape: prompts are cut from the left to
fit ``seq_len`` and a candidate longer than ``answer_len`` is an error; the last chunk is padded with copies of
its first row, whose results are dropped.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from device_agent.batches import Shape
from shared.batch import IGNORE_INDEX
from shared.data import Encoded


class Evaluator(Protocol):
    def evaluate(self, input_ids: np.ndarray, attention_mask: np.ndarray, targets: np.ndarray) -> np.ndarray: ...


def _row_losses(session: Evaluator, rows: list[Encoded], shape: Shape, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(mean loss, answer token count) of every row, run in chunks of the program's row count."""
    from shared.data import training_batch

    losses, counts = [], []
    for start in range(0, len(rows), shape.rows):
        chunk = rows[start : start + shape.rows]
        filled = chunk + [chunk[0]] * (shape.rows - len(chunk))
        batch = training_batch(filled, pad_id, shape.seq_len, shape.answer_len)
        out = session.evaluate(batch.input_ids.numpy(), batch.attention_mask.numpy(), batch.targets.numpy())
        losses.append(out[: len(chunk)])
        counts.append((batch.targets != IGNORE_INDEX).sum(dim=1).numpy()[: len(chunk)])
    return np.concatenate(losses).astype(np.float64), np.concatenate(counts)


def evaluate_program(session: Evaluator, rendered: list, tokenizer: Any, shape: Shape, kind: str) -> dict[str, Any]:
    """``{"accuracy", "loss", "n"}`` of the program's current B on rendered examples (accuracy None for ``lm``)."""
    predictions, labels, loss = predict(session, rendered, tokenizer, shape)
    accuracy = None
    if kind != "lm":
        accuracy = sum(p == y for p, y in zip(predictions, labels, strict=True)) / len(labels)
    return {"accuracy": accuracy, "loss": loss, "n": len(labels)}


def predict(session: Evaluator, rendered: list, tokenizer: Any, shape: Shape) -> tuple[list[int], list[int], float]:
    """(each example's predicted candidate, its label, the loss) of the program's current B: what
    ``evaluate_program`` summarises, kept per example where two programs are compared (``benchmarks``)."""
    from shared.data import encode, pad_token_id

    encoded = encode(rendered, tokenizer, shape.seq_len)
    pairs = [(i, c) for i, e in enumerate(encoded) for c in range(len(e.candidate_ids))]
    rows = [Encoded(encoded[i].prompt_ids, [encoded[i].candidate_ids[c]], 0) for i, c in pairs]
    losses, counts = _row_losses(session, rows, shape, pad_token_id(tokenizer))
    by_example: dict[int, list[tuple[float, int]]] = {}
    for (i, _), loss, count in zip(pairs, losses, counts, strict=True):
        by_example.setdefault(i, []).append((float(loss), int(count)))
    labels = [e.label for e in encoded]
    correct = [by_example[i][y] for i, y in enumerate(labels)]
    loss = sum(mean * count for mean, count in correct) / sum(count for _, count in correct)
    predictions = [min(range(len(scores)), key=lambda c: scores[c][0]) for scores in by_example.values()]
    return predictions, labels, loss
