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

Where the method runs is an ``Evaluator``: the ExecuTorch runtime in this process
(``device_agent.et_program.ProgramSession``) or the native runner's ``evaluate`` mode
(``device_agent.runner_evaluator.RunnerEvaluator``), as the backend that trained says (``Backend.evaluator``). It
takes every B to measure and every chunk at once, so the runner loads the program once for all of a job's points.
The rows are NumPy arrays (``shared.data.training_arrays``): this module needs no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from device_agent.batches import Shape
from shared.calibration import calibrated
from shared.data import Encoded
from shared.evaluate import candidate_loss

Chunk = tuple[np.ndarray, np.ndarray, np.ndarray]  # input_ids, attention_mask, targets: int64, the program's shape


class Evaluator(Protocol):
    def evaluate_points(self, points: Sequence[np.ndarray], chunks: Sequence[Chunk]) -> list[np.ndarray]:
        """For each B of ``points`` (flat float32), the program's ``evaluate`` output of every chunk under it,
        stacked: ``[chunks, rows]`` (per-row losses) or ``[chunks, rows, C]`` (candidate scores)."""
        ...


class Session(Protocol):
    """A program's ``evaluate`` at the B it holds, one chunk at a time (``ProgramSession``)."""

    def evaluate(self, input_ids: np.ndarray, attention_mask: np.ndarray, targets: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class Rows:
    """Held-out examples as the program's rows, encoded once for every B they are measured at."""

    chunks: list[Chunk]
    count: int  # the real rows (the last chunk's padding copies are not)
    labels: list[int]
    # lm: the (example, candidate) of each row and its answer tokens; classification (one row per example): None
    pairs: list[tuple[int, int]] | None = None
    tokens: list[int] | None = None


def program_rows(rendered: list, tokenizer: Any, shape: Shape, candidates: tuple[int, ...] = ()) -> Rows:
    """The rows of rendered examples in chunks of the program's row count: one row per example (answer: its
    label) for a classification program (``candidates``), else one per (example, candidate) pair."""
    from shared.data import check_candidates, encode, pad_token_id

    if not rendered:
        raise ValueError("held-out evaluation needs at least one example")
    encoded = encode(rendered, tokenizer, shape.seq_len)
    pad = pad_token_id(tokenizer)
    labels = [e.label for e in encoded]
    if candidates:  # a classification program scores every candidate of a row in one pass
        check_candidates(encoded, candidates)
        return Rows(_chunks(encoded, shape, pad), len(encoded), labels)
    pairs = [(i, c) for i, e in enumerate(encoded) for c in range(len(e.candidate_ids))]
    rows = [Encoded(encoded[i].prompt_ids, [encoded[i].candidate_ids[c]], 0) for i, c in pairs]
    tokens = [len(row.candidate_ids[0]) for row in rows]
    return Rows(_chunks(rows, shape, pad), len(rows), labels, pairs, tokens)


def _chunks(rows: list[Encoded], shape: Shape, pad_id: int) -> list[Chunk]:
    """Rows (each answering with its first candidate) in chunks of ``shape.rows``, the last filled with copies of
    its first row."""
    from shared.data import training_arrays

    chunks = []
    for start in range(0, len(rows), shape.rows):
        chunk = rows[start : start + shape.rows]
        filled = chunk + [chunk[0]] * (shape.rows - len(chunk))
        chunks.append(training_arrays(filled, pad_id, shape.seq_len, shape.answer_len))
    return chunks


def summarise(rows: Rows, outputs: np.ndarray, prior: tuple[float, ...] = ()) -> tuple[list[int], list[int], float]:
    """(each example's predicted candidate, its label, the loss) from the program's output of ``rows``' chunks
    (stacked, as an ``Evaluator`` gives them) at one B; ``prior``: a calibrated program's, divided out of the
    scores as ``mobizo eval --calibrate`` does."""
    values = np.asarray(outputs).reshape(-1, *np.shape(outputs)[2:])[: rows.count]
    labels = rows.labels
    if rows.pairs is None:
        scores = [calibrated([float(v) for v in row], prior or None) for row in values]
        loss = sum(candidate_loss(row, y) for row, y in zip(scores, labels, strict=True)) / len(labels)
        return [max(range(len(row)), key=row.__getitem__) for row in scores], labels, loss
    losses = values.astype(np.float64)
    if losses.ndim != 1:
        raise ValueError("the program scores candidates (a classification program): pass its config's candidates")
    by_example: dict[int, list[tuple[float, int]]] = {}
    for (i, _), mean, count in zip(rows.pairs, losses, rows.tokens, strict=True):
        by_example.setdefault(i, []).append((float(mean), int(count)))
    correct = [by_example[i][y] for i, y in enumerate(labels)]
    loss = sum(mean * count for mean, count in correct) / sum(count for _, count in correct)
    predictions = [min(range(len(scores)), key=lambda c: scores[c][0]) for scores in by_example.values()]
    return predictions, labels, loss


def _figures(kind: str, predictions: list[int], labels: list[int], loss: float) -> dict[str, Any]:
    """``{"accuracy", "loss", "n"}``; ``lm``: no accuracy, and ``perplexity``, exp of the per-token loss."""
    from shared.schemas import perplexity

    if kind == "lm":
        return {"accuracy": None, "loss": loss, "n": len(labels), "perplexity": perplexity(loss)}
    accuracy = sum(p == y for p, y in zip(predictions, labels, strict=True)) / len(labels)
    return {"accuracy": accuracy, "loss": loss, "n": len(labels)}


def evaluate_points(
    evaluator: Evaluator,
    points: Sequence[np.ndarray],
    rendered: list,
    tokenizer: Any,
    shape: Shape,
    kind: str,
    candidates: tuple[int, ...] = (),
    prior: tuple[float, ...] = (),
) -> list[dict[str, Any]]:
    """``{"accuracy", "loss", "n"}`` of the program at each B of ``points`` on rendered examples (accuracy None for
    ``lm``, which adds ``perplexity``), the rows encoded once and measured by ``evaluator`` in one call;
    ``candidates`` and ``prior`` as in ``evaluate_program``."""
    rows = program_rows(rendered, tokenizer, shape, candidates)
    outputs = evaluator.evaluate_points(points, rows.chunks)
    if len(outputs) != len(points):
        raise ValueError(f"the evaluator measured {len(outputs)} points of {len(points)}")
    return [_figures(kind, *summarise(rows, out, prior)) for out in outputs]


def evaluate_program(
    session: Session,
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
    return _figures(kind, *predict(session, rendered, tokenizer, shape, candidates, prior))


def predict(
    session: Session,
    rendered: list,
    tokenizer: Any,
    shape: Shape,
    candidates: tuple[int, ...] = (),
    prior: tuple[float, ...] = (),
) -> tuple[list[int], list[int], float]:
    """(each example's predicted candidate, its label, the loss) of the program's current B: what
    ``evaluate_program`` summarises, kept per example where two programs are compared (``benchmarks``)."""
    rows = program_rows(rendered, tokenizer, shape, candidates)
    return summarise(rows, np.stack([session.evaluate(*chunk) for chunk in rows.chunks]), prior)
