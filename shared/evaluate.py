"""Accuracy and loss of a causal LM on a task, by scoring candidate answers with the model's likelihood.

A candidate's score is the mean log-likelihood of its tokens given the prompt, which does not favour short answers
the way a sum would; the prediction is the best-scoring candidate. When every candidate is one token, one row per
example scores them all (the logits at the answer position hold every candidate's); otherwise each (example,
candidate) pair is one row of a left-padded batch (``shared.data.training_batch``), C rows per example. The loss
is the training objective's: ``lm``, cross-entropy over the whole vocabulary averaged over the tokens of the
correct answers; ``classification``, the mean over examples of the cross-entropy of the candidates' scores.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from shared.batch import IGNORE_INDEX
from shared.calibration import calibrated
from shared.data import Encoded, encode, pad_token_id, resolve_objective, training_batch
from shared.tasks import Rendered, Task

if TYPE_CHECKING:  # torch only where a model runs: a device scores its program's outputs with candidate_loss alone
    import torch


def _answer_nll(
    model: Any, rows: list[Encoded], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed negative log-likelihood of each row's answer tokens, and how many tokens that is (CPU tensors)."""
    import torch.nn.functional as F

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


def _score_single_tokens(
    model: Any, encoded: list[Encoded], pad_id: int, batch_size: int, progress: bool
) -> tuple[list[list[float]], list[list[int]]]:
    """``_score_all`` for examples whose candidates are all single tokens: one row per example."""
    import torch
    from tqdm import tqdm

    device = next(model.parameters()).device
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i].prompt_ids))  # chunks pad little
    nll: list[list[float]] = [[] for _ in encoded]
    for start in tqdm(range(0, len(order), batch_size), desc="eval", unit="batch", disable=not progress):
        chunk = order[start : start + batch_size]
        batch = training_batch([encoded[i] for i in chunk], pad_id)
        logits = model(
            input_ids=batch.input_ids.to(device),
            attention_mask=batch.attention_mask.to(device),
            position_ids=batch.position_ids.to(device),
            logits_to_keep=2,
        ).logits[:, 0]
        log_probs = torch.log_softmax(logits.float(), dim=-1).cpu()
        for row, i in enumerate(chunk):
            ids = [c[0] for c in encoded[i].candidate_ids]
            nll[i] = (-log_probs[row, ids]).tolist()
    return nll, [[1] * len(row) for row in nll]


def _score_all(
    model: Any, encoded: list[Encoded], pad_id: int, batch_size: int, progress: bool
) -> tuple[list[list[float]], list[list[int]]]:
    """Summed NLL and token count for every candidate of every example: ``[example][candidate]``."""
    from tqdm import tqdm

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
    objective: str | None = None,
    prior: tuple[float, ...] | None = None,
) -> dict[str, Any]:
    """``{"accuracy", "loss", "n"}`` of ``model`` on the rendered examples (accuracy is None for ``lm`` tasks, which
    add ``perplexity``, exp of the per-token loss); the loss is ``objective``'s (module docstring; None: the task's
    default, ``shared.data.resolve_objective``).

    ``batch_size`` counts rows per forward pass; ``max_len`` truncates prompts as ``shared.data.encode`` does. The
    model runs in eval mode under ``no_grad`` and gets its mode back after. ``prior``: a classification prompt's
    content-free prior (``shared.calibration``), divided out of every example's scores before its prediction and loss.
    """
    if not rendered:
        raise ValueError("evaluate needs at least one example")
    objective, _, _ = resolve_objective(task, tokenizer, objective)
    encoded = encode(rendered, tokenizer, max_len)
    nll, count = _scored(model, encoded, pad_token_id(tokenizer), batch_size, progress)
    labels = [e.label for e in encoded]
    rows = [calibrated(scores(n, c), prior) for n, c in zip(nll, count, strict=True)]
    if objective == "classification":
        loss = sum(candidate_loss(row, y) for row, y in zip(rows, labels, strict=True)) / len(labels)
    else:
        loss = sum(row[y] for row, y in zip(nll, labels)) / sum(row[y] for row, y in zip(count, labels))
    if task.kind == "lm":
        from shared.schemas import perplexity

        return {
            "accuracy": None,
            "loss": loss,
            "n": len(encoded),
            "objective": objective,
            "perplexity": perplexity(loss),
        }
    hits = [_best(row) == y for row, y in zip(rows, labels, strict=True)]
    return {"accuracy": sum(hits) / len(hits), "loss": loss, "n": len(encoded), "objective": objective}


def _scored(
    model: Any, encoded: list[Encoded], pad_id: int, batch_size: int, progress: bool
) -> tuple[list[list[float]], list[list[int]]]:
    """Summed NLL and token count of every candidate of every example, in eval mode under ``no_grad``."""
    import torch

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            single = all(len(c) == 1 for e in encoded for c in e.candidate_ids)
            score = _score_single_tokens if single else _score_all
            return score(model, encoded, pad_id, batch_size, progress)
    finally:
        model.train(was_training)


def candidate_scores(
    model: Any, tokenizer: Any, rendered: list[Rendered], batch_size: int = 16, max_len: int | None = None
) -> list[list[float]]:
    """Every example's candidate scores (mean log-likelihoods), ``evaluate``'s."""
    nll, count = _scored(model, encode(rendered, tokenizer, max_len), pad_token_id(tokenizer), batch_size, False)
    return [scores(n, c) for n, c in zip(nll, count, strict=True)]


def scores(nll: list[float], count: list[int]) -> list[float]:
    """The candidates' scores: their mean log-likelihoods."""
    return [-n / c for n, c in zip(nll, count, strict=True)]


def candidate_loss(row: list[float], label: int) -> float:
    """The classification objective's loss of one example from its candidates' scores: their cross-entropy,
    log-sum-exp of the scores minus the label's (``shared.zo.example_losses`` in float32)."""
    top = max(row)
    return top + math.log(sum(math.exp(s - top) for s in row)) - row[label]


def _best(row: list[float]) -> int:
    """The candidate with the highest score (the first one on a tie)."""
    return max(range(len(row)), key=row.__getitem__)


def measure_prior(model: Any, tokenizer: Any, task: Task, max_len: int | None = None) -> tuple[float, ...]:
    """The content-free prior of ``task``'s prompt on ``model`` as it is (``shared.calibration``; call it before an
    adapter is applied)."""
    from shared.calibration import content_free, prior_of

    if task.kind != "classification":
        raise ValueError(f"calibration needs a classification task, not {task.kind}")
    return prior_of(candidate_scores(model, tokenizer, content_free(task), max_len=max_len))
