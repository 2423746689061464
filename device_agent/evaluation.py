"""Accuracy and loss on held-out data with the program's own ``evaluate`` method (master B, no perturbation).

Why the program and not PyTorch: a device has the ``.pte``, the ``.ptd`` and the tokenizer, not a model PyTorch
can run, and the program's ``evaluate`` gives exactly what accuracy needs. A classification program (objective
``classification``) scores all its single-token candidates in one row per example: the method returns each row's
candidates' log-likelihoods. Otherwise each (example, candidate) pair is one row and the method returns the row's
mean cross-entropy over its answer tokens, i.e. minus the candidate's mean log-likelihood. Either way the score is
``shared.evaluate``'s, so the prediction (the best-scoring candidate, the first on a tie) and the loss (the
objective's) are ``mobizo eval``'s, computed by the device's kernels with the device's B. Rows have the program's
shape: prompts are cut from the left to fit ``seq_len`` (a chunk runs at its longest row) and a candidate longer
than ``answer_len`` is an error; the last chunk is padded with copies of its first row, whose results are
dropped.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from device_agent.batches import Shape
from shared.calibration import calibrated
from shared.data import Encoded
from shared.evaluate import candidate_loss


class Evaluator(Protocol):
    def evaluate(self, input_ids: np.ndarray, attention_mask: np.ndarray, targets: np.ndarray) -> np.ndarray: ...


def _program_rows(session: Evaluator, rows: list[Encoded], shape: Shape, pad_id: int) -> np.ndarray:
    """The program's ``evaluate`` output for every row (its answer being its first candidate), run in chunks of
    the program's row count: a row's mean loss, or a classification program's candidate scores."""
    from shared.data import training_batch

    out = []
    for start in range(0, len(rows), shape.rows):
        chunk = rows[start : start + shape.rows]
        filled = chunk + [chunk[0]] * (shape.rows - len(chunk))
        batch = training_batch(filled, pad_id, shape.seq_len, shape.answer_len)
        values = session.evaluate(batch.input_ids.numpy(), batch.attention_mask.numpy(), batch.targets.numpy())
        out.append(values[: len(chunk)])
    return np.concatenate(out)


def evaluate_program(
    session: Evaluator,
    rendered: list,
    tokenizer: Any,
    shape: Shape,
    kind: str,
    candidates: tuple[int, ...] = (),
    prior: tuple[float, ...] = (),
) -> dict[str, Any]:
    """``{"accuracy", "loss", "n"}`` of the program's current B on rendered examples (accuracy None for ``lm``,
    which adds ``perplexity``, exp of its per-token loss); ``candidates``: a classification program's
    (``ProgramConfig.candidates``), whose loss is that objective's; ``prior``: a calibrated program's
    (``ProgramConfig.prior``), divided out of the scores as ``mobizo eval --calibrate`` does."""
    from shared.schemas import perplexity

    predictions, labels, loss = predict(session, rendered, tokenizer, shape, candidates, prior)
    if kind == "lm":
        return {"accuracy": None, "loss": loss, "n": len(labels), "perplexity": perplexity(loss)}
    accuracy = sum(p == y for p, y in zip(predictions, labels, strict=True)) / len(labels)
    return {"accuracy": accuracy, "loss": loss, "n": len(labels)}


def predict(
    session: Evaluator,
    rendered: list,
    tokenizer: Any,
    shape: Shape,
    candidates: tuple[int, ...] = (),
    prior: tuple[float, ...] = (),
) -> tuple[list[int], list[int], float]:
    """(each example's predicted candidate, its label, the loss) of the program's current B: what
    ``evaluate_program`` summarises, kept per example where two programs are compared (``benchmarks``)."""
    from shared.data import check_candidates, encode, pad_token_id

    encoded = encode(rendered, tokenizer, shape.seq_len)
    labels = [e.label for e in encoded]
    if candidates:  # a classification program scores every candidate of a row in one pass
        check_candidates(encoded, candidates)
        rows = _program_rows(session, encoded, shape, pad_token_id(tokenizer))
        scores = [calibrated([float(v) for v in row], prior or None) for row in rows]
        loss = sum(candidate_loss(row, y) for row, y in zip(scores, labels, strict=True)) / len(labels)
        return [max(range(len(row)), key=row.__getitem__) for row in scores], labels, loss
    pairs = [(i, c) for i, e in enumerate(encoded) for c in range(len(e.candidate_ids))]
    rows = [Encoded(encoded[i].prompt_ids, [encoded[i].candidate_ids[c]], 0) for i, c in pairs]
    losses = _program_rows(session, rows, shape, pad_token_id(tokenizer)).astype(np.float64)
    if losses.ndim != 1:
        raise ValueError("the program scores candidates (a classification program): pass its config's candidates")
    counts = np.asarray([len(row.candidate_ids[0]) for row in rows])
    by_example: dict[int, list[tuple[float, int]]] = {}
    for (i, _), mean, count in zip(pairs, losses, counts, strict=True):
        by_example.setdefault(i, []).append((float(mean), int(count)))
    correct = [by_example[i][y] for i, y in enumerate(labels)]
    loss = sum(mean * count for mean, count in correct) / sum(count for _, count in correct)
    predictions = [min(range(len(scores)), key=lambda c: scores[c][0]) for scores in by_example.values()]
    return predictions, labels, loss
