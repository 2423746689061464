"""Examples from JSON Lines files to token ids to left-padded batches, and the deterministic batch order.

Batches put every answer at the right edge (LEFT padding), so one slice of the logits, the last L+1 columns,
scores every row whatever its length; see docs/contracts.md. A batch is padded only to its own longest row unless
the caller fixes ``seq_len`` (a device's batches file has one record size; its program then runs each batch at its
longest row again, ``device_agent.batches.fit_width``), so short queries pad less.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from shared.batch import IGNORE_INDEX, Batch, position_ids
from shared.errors import DataError, UsageError
from shared.tasks import Rendered, Task, placeholder_record


def _records(path: str | os.PathLike[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line; ``DataError`` at the first line that is not an object."""
    try:
        handle = open(path, "rb")
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror})") from None
    with handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                record = json.loads(line)
            except UnicodeDecodeError:
                raise DataError(f"{path}:{number}: not valid UTF-8") from None
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{number}: invalid JSON ({exc.msg}, column {exc.colno})") from None
            if not isinstance(record, dict):
                raise DataError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
            yield number, record


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every object in a JSON Lines file (blank lines skipped); a file without any is an error."""
    records = [record for _, record in _records(path)]
    if not records:
        raise DataError(f"{path}: no examples (the file is empty)")
    return records


def load_examples(task: Task, path: str | os.PathLike[str], limit: int | None = None) -> list[Rendered]:
    """The first ``limit`` (default all) examples of a file, rendered by ``task``: a row per record, or a ``text``
    record's rows (``Task.rows``), in order.

    The whole file is checked even with a limit, so a run never starts on a file it cannot fully read.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    rendered = [row for rows in load_records_rows(task, path) for row in rows]
    return rendered if limit is None else rendered[:limit]


def load_records_rows(task: Task, path: str | os.PathLike[str]) -> list[list[Rendered]]:
    """Each record's rows (``Task.rows``), record by record: what a device splits by record, so that a record's
    rows are all trained on or all held out."""
    rows: list[list[Rendered]] = []
    for number, record in _records(path):
        try:
            rows.append(task.rows(record))
        except DataError as exc:
            raise DataError(f"{path}:{number}: {exc}") from None
    if not rows:
        raise DataError(f"{path}: no examples (the file is empty)")
    return rows


@dataclass(frozen=True)
class Encoded:
    """One example as token ids: the prompt (with BOS where the tokenizer adds one) and each candidate."""

    prompt_ids: list[int]
    candidate_ids: list[list[int]]
    label: int


def _token_ids(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    return list(tokenizer(texts, add_special_tokens=False)["input_ids"]) if texts else []


def _bos(tokenizer: Any) -> list[int]:
    """[BOS] if the tokenizer defines a BOS token and puts it in front of text, else []."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return []
    return [bos] if tokenizer("a", add_special_tokens=True)["input_ids"][:1] == [bos] else []


def _answer_ids(tokenizer: Any, prompt_ids: list[int], joined_ids: list[int], candidate: str) -> list[int]:
    """Candidate tokens as they follow the prompt: taken from the tokenized prompt+candidate when it extends the
    tokenized prompt (SentencePiece tokenizers would otherwise add a spurious word-start to a leading space),
    else the candidate tokenized on its own."""
    if len(joined_ids) > len(prompt_ids) and joined_ids[: len(prompt_ids)] == prompt_ids:
        return joined_ids[len(prompt_ids) :]
    ids = _token_ids(tokenizer, [candidate])[0]
    if not ids:
        raise DataError(f"candidate {candidate!r} encodes to no tokens")
    return ids


def _fit(index: int, bos: list[int], text_ids: list[int], answers: list[list[int]], max_len: int | None) -> list[int]:
    """The prompt ids, cut from the left (after BOS) so that prompt + longest answer <= max_len."""
    if max_len is not None:
        longest = max(map(len, answers))
        room = max_len - len(bos) - longest
        if room < (0 if bos else 1):
            raise DataError(f"example {index}: an answer of {longest} tokens leaves no room for a prompt in {max_len}")
        text_ids = text_ids[max(0, len(text_ids) - room) :]
    prompt = bos + text_ids
    if not prompt:
        raise DataError(f"example {index}: empty prompt and no BOS token: nothing predicts the first answer token")
    return prompt


def encode(rendered: list[Rendered], tokenizer: Any, max_len: int | None = None) -> list[Encoded]:
    """Token ids for rendered examples. Candidates carry no special tokens.

    Truncation: when ``max_len`` is given, the prompt loses tokens from its LEFT end (BOS stays first), because
    the end of a prompt holds the question and the answer cue; it is cut until prompt + longest candidate fits in
    ``max_len``. A candidate too long to fit even after an empty prompt is a ``DataError``.
    """
    bos = _bos(tokenizer)
    prompts = _token_ids(tokenizer, [r.prompt for r in rendered])
    joined = iter(_token_ids(tokenizer, [r.prompt + c for r in rendered for c in r.candidates]))
    encoded = []
    for i, (example, text_ids) in enumerate(zip(rendered, prompts, strict=True)):
        answers = [_answer_ids(tokenizer, text_ids, next(joined), c) for c in example.candidates]
        encoded.append(Encoded(_fit(i, bos, text_ids, answers, max_len), answers, example.label))
    return encoded


def answer_len(examples: list[Encoded]) -> int:
    """Length of the longest correct answer (the L of a batch of these examples)."""
    return max(len(e.candidate_ids[e.label]) for e in examples)


def _check_row(i: int, example: Encoded, seq_len: int, answer_cols: int) -> None:
    answer = example.candidate_ids[example.label]
    if not example.prompt_ids or not answer:
        raise DataError(f"example {i}: a row needs at least one prompt token and one answer token")
    if len(answer) > answer_cols:
        raise DataError(f"example {i}: answer of {len(answer)} tokens is longer than answer_len {answer_cols}")
    if len(example.prompt_ids) + len(answer) > seq_len:
        raise DataError(f"example {i}: {len(example.prompt_ids) + len(answer)} tokens do not fit in seq_len {seq_len}")


def training_arrays(
    examples: list[Encoded], pad_id: int, seq_len: int | None = None, answer_len: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(input_ids, attention_mask, targets), int64 arrays: rows of prompt + correct answer, left-padded to
    ``seq_len`` (default: the longest row), with the answer tokens as targets in the last ``answer_len`` columns
    (default: the longest answer). Rows that do not fit are a ``DataError``, never silently cut. NumPy, so a device
    without torch builds its batches (``device_agent.local_data``); ``training_batch`` is the same as tensors."""
    if not examples:
        raise ValueError("a batch needs at least one example")
    answers = [e.candidate_ids[e.label] for e in examples]
    cols = answer_len if answer_len is not None else max(map(len, answers))
    longest_row = max(len(e.prompt_ids) + len(a) for e, a in zip(examples, answers))
    width = seq_len if seq_len is not None else max(longest_row, cols + 1)
    if width < cols + 1:
        raise DataError(f"seq_len {width} leaves no column before an answer of {cols} tokens")
    input_ids = np.full((len(examples), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(examples), width), dtype=np.int64)
    targets = np.full((len(examples), cols), IGNORE_INDEX, dtype=np.int64)
    for i, (example, answer) in enumerate(zip(examples, answers)):
        _check_row(i, example, width, cols)
        row = example.prompt_ids + answer
        input_ids[i, width - len(row) :] = row
        mask[i, width - len(row) :] = 1
        targets[i, cols - len(answer) :] = answer
    return input_ids, mask, targets


def training_batch(
    examples: list[Encoded], pad_id: int, seq_len: int | None = None, answer_len: int | None = None
) -> Batch:
    """``training_arrays`` as the ``Batch`` of torch tensors the algorithm trains on (its position ids added)."""
    import torch

    input_ids, mask, targets = (torch.from_numpy(a) for a in training_arrays(examples, pad_id, seq_len, answer_len))
    return Batch(input_ids, mask, position_ids(mask), targets)


def pad_token_id(tokenizer: Any) -> int:
    """The id to pad with: the pad token, else EOS, else 0 (padded columns are masked, so any id works)."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0


@lru_cache(maxsize=4)
def _epoch_order(n_examples: int, epoch_seed: int) -> np.ndarray:
    order = np.random.Generator(np.random.PCG64(epoch_seed)).permutation(n_examples)
    order.flags.writeable = False
    return order


def batch_indices(
    n_examples: int, batch_size: int, seed: int, step: int, lengths: Sequence[int] | None = None, bucket: int = 1
) -> list[int]:
    """Example indices for ``step`` (counted from 0): positions ``step*batch_size ...`` of the endless walk through
    epoch permutations, epoch e shuffled by ``PCG64(seed + e)``. A pure function of its arguments, so a resumed or
    replayed run sees the same batches whatever ran before.

    ``bucket`` B > 1 with the examples' ``lengths`` (tokens): the walk is cut into windows of B batches, each window's
    examples sorted by length and dealt into its B batches, shortest first, and the window's batches taken in an
    order shuffled by ``PCG64([seed, window])``. A batch then holds examples of similar lengths, so it pads little (a
    program runs a batch at its longest row), and every epoch still visits each example once."""
    if n_examples < 1 or batch_size < 1 or step < 0 or bucket < 1:
        raise ValueError(
            f"need n_examples >= 1, batch_size >= 1, step >= 0, bucket >= 1 (got {n_examples}, {batch_size}, {step}, "
            f"{bucket})"
        )

    def walk(start: int, count: int) -> list[int]:
        return [
            int(_epoch_order(n_examples, seed + p // n_examples)[p % n_examples]) for p in range(start, start + count)
        ]

    if bucket == 1:
        return walk(step * batch_size, batch_size)
    if lengths is None or len(lengths) != n_examples:
        raise ValueError(f"bucket {bucket} needs the length of each of the {n_examples} examples")
    window, slot = divmod(step, bucket)
    examples = sorted(walk(window * bucket * batch_size, bucket * batch_size), key=lambda i: (lengths[i], i))
    order = np.random.Generator(np.random.PCG64([seed, window])).permutation(bucket)
    start = int(order[slot]) * batch_size
    return examples[start : start + batch_size]


def answer_len_for(task: Task, tokenizer: Any) -> int:
    """Tokens of a classification task's longest answer as it follows the task's prompt: the answer length a
    fixed-shape program needs. Other kinds take their answers from the data, so the caller must say."""
    if task.kind != "classification":
        raise UsageError("answer_len", f"is required for task {task.name} (its answers come from the data)")
    (encoded,) = encode([task.render(placeholder_record(task))], tokenizer)
    return max(map(len, encoded.candidate_ids))


def single_token_candidates(task: Task, tokenizer: Any) -> tuple[int, ...] | None:
    """The token ids of a classification task's candidates as they follow its prompt, in label order, when each is
    one token; None when one is longer or the answers come from the data (not a classification task)."""
    if task.kind != "classification":
        return None
    (encoded,) = encode([task.render(placeholder_record(task))], tokenizer)
    if any(len(ids) != 1 for ids in encoded.candidate_ids):
        return None
    return tuple(ids[0] for ids in encoded.candidate_ids)


def resolve_objective(
    task: Task, tokenizer: Any, requested: str | None = None, answer_len: int | None = None
) -> tuple[str, tuple[int, ...], int | None]:
    """(objective, candidate ids, answer length) of a run or program: ``requested``, or by default
    ``classification`` for a classification task whose candidates are single tokens (unless ``answer_len`` fixes
    longer answers, which only ``lm`` trains) and ``lm`` otherwise. The answer length is ``answer_len``, else 1 for
    the classification objective, else the task's longest answer (``answer_len_for``; None when the answers come
    from the data: a program then needs it given). ``UsageError`` naming the field when the classification
    objective cannot apply (multi-token candidates would need a row per candidate)."""
    from shared.backends import OBJECTIVES

    if requested is not None and requested not in OBJECTIVES:
        raise UsageError("objective", f"unknown objective {requested!r} (choose from {', '.join(OBJECTIVES)})")
    ids = single_token_candidates(task, tokenizer)
    if requested is None:
        requested = "lm" if ids is None or (answer_len or 1) > 1 else "classification"
    if requested == "lm":  # answers from the data (not a classification task) have no length of their own
        return "lm", (), answer_len or (answer_len_for(task, tokenizer) if task.kind == "classification" else None)
    if task.kind != "classification":
        raise UsageError("objective", f"classification needs a task with a verbalizer; {task.name} is {task.kind}")
    if ids is None:
        rendered = task.render(placeholder_record(task))
        (encoded,) = encode([rendered], tokenizer)
        lengths = ", ".join(f"{c!r} {len(t)}" for c, t in zip(rendered.candidates, encoded.candidate_ids, strict=True))
        raise UsageError(
            "objective", f"classification needs single-token answers; this tokenizer's are {lengths} tokens (use lm)"
        )
    if answer_len not in (None, 1):
        raise UsageError("answer_len", f"the classification objective scores one answer token, not {answer_len}")
    return "classification", ids, 1


def check_candidates(encoded: list[Encoded], candidates: tuple[int, ...]) -> None:
    """Every example's candidates must be the task's single tokens (``DataError`` naming the first that is not),
    so that the classification loss finds each row's answer among them."""
    expected = [[c] for c in candidates]
    for i, example in enumerate(encoded):
        if example.candidate_ids != expected:
            raise DataError(f"example {i}: its answers encode to {example.candidate_ids}, not the task's {expected}")


def prompt_token_ids(tokenizer: Any, text: str) -> list[int]:
    """A free-text prompt as the model sees it in training: [BOS] (when the tokenizer uses one) + the text's tokens."""
    return _bos(tokenizer) + _token_ids(tokenizer, [text])[0]
