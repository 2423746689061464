"""The pre-tokenized batches file: every training step's data, written once on the host, read by every backend.

The device never tokenizes: the agent renders and tokenizes the local data, fixes each step's batch and seed, and
writes them here. The native runner (``device_agent/runner``) and the Python backends read the same bytes, so a
run is the same run on every backend, and resuming at step k is one seek.

Format (this is its one specification; ``runner/runner_io.cpp`` mirrors it). All integers little-endian.

    header, 32 bytes:
        magic       8 bytes   b"MZBATCH2"
        rows        uint32    q*E, the rows of every step (the program's batch dimension)
        seq_len     uint32    T, columns of input_ids / attention_mask
        answer_len  uint32    L, columns of targets (L < T)
        steps       uint32    N, number of step records
        reserved    8 bytes   zero
    then N records of identical size, record k for step k:
        seed            int64               the step's noise seed (shared.noise.step_seed)
        lr              float32             the step's learning rate (shared.schedule.lr_at), as the program takes it
        reserved        4 bytes             zero (keeps the arrays 8-byte aligned)
        input_ids       int32[rows*T]       row-major
        attention_mask  uint8[rows*T]       0 or 1
        targets         int32[rows*L]       token ids, -100 where a column is not an answer token

Ids are stored narrower than the program's int64 inputs (readers widen them) to keep long runs small on a
phone: a record is 16 + 5*rows*T + 4*rows*L bytes. The lr of each step is here, so every backend runs the job's
schedule from the same bytes; eps is a per-run argument. (``MZBATCH1``, with no lr, is not read any more: a job's
batches are rebuilt from its data when the agent finds an old file.)
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from shared.errors import DataError
from shared.files import atomic_write

MAGIC = b"MZBATCH2"
HEADER = struct.Struct("<8s4I8x")
STEP_HEAD = struct.Struct("<qf4x")  # seed, lr, reserved
_INT32 = np.iinfo(np.int32)


@dataclass(frozen=True)
class StepBatch:
    """One step's inputs as the program takes them (int64 arrays)."""

    seed: int
    lr: float  # the step's float32 learning rate, as a Python float
    input_ids: np.ndarray  # [rows, T]
    attention_mask: np.ndarray  # [rows, T]
    targets: np.ndarray  # [rows, L]


@dataclass(frozen=True)
class Shape:
    rows: int
    seq_len: int
    answer_len: int

    def record_size(self) -> int:
        cells = self.rows * self.seq_len
        return STEP_HEAD.size + 5 * cells + 4 * self.rows * self.answer_len


def _narrow(name: str, values: object, shape: tuple[int, int], dtype: str, low: int, high: int) -> bytes:
    array = np.asarray(values)
    if array.shape != shape:
        raise DataError(f"batches: {name} has shape {list(array.shape)}, expected {list(shape)}")
    if array.size and (array.min() < low or array.max() > high):
        raise DataError(f"batches: {name} has values outside [{low}, {high}]")
    return array.astype(dtype).tobytes()


def _lr(value: float) -> float:
    lr = float(value)
    if not (math.isfinite(lr) and lr > 0) or float(np.float32(lr)) != lr:
        raise DataError(f"batches: lr {value!r} is not a positive float32 value (round it: shared.schedule.lr_at)")
    return lr


def fit_width(
    input_ids: np.ndarray, attention_mask: np.ndarray, widths: tuple[int, int] | None
) -> tuple[np.ndarray, np.ndarray]:
    """A left-padded batch at the columns a program of input ``widths`` runs it at (``ProgramInputs.widths``): its
    longest row, but at least the program's narrowest; the padding columns before are cut (or, for a batch
    narrower than that, added). ``widths`` None: a program of one width, the batch as it is. The native runner
    does the same (``runner/main.cpp``, ``--min-width``)."""
    if widths is None:
        return input_ids, attention_mask
    low, high = widths
    columns = attention_mask.shape[1]
    used = attention_mask.any(axis=0)
    longest = columns - int(np.argmax(used)) if used.any() else 0
    if longest > high:
        raise DataError(f"batches: a row of {longest} tokens does not fit the program's {high} columns")
    width = max(longest, low)
    if width <= columns:
        return input_ids[:, columns - width :], attention_mask[:, columns - width :]
    pad = ((0, 0), (width - columns, 0))
    return np.pad(input_ids, pad), np.pad(attention_mask, pad)


def encode_step(shape: Shape, step: StepBatch) -> bytes:
    """The bytes of one record; ``DataError`` when a tensor has the wrong shape or an out-of-range value."""
    grid, answers = (shape.rows, shape.seq_len), (shape.rows, shape.answer_len)
    return b"".join(
        [
            STEP_HEAD.pack(int(step.seed), _lr(step.lr)),
            _narrow("input_ids", step.input_ids, grid, "<i4", 0, _INT32.max),
            _narrow("attention_mask", step.attention_mask, grid, "u1", 0, 1),
            _narrow("targets", step.targets, answers, "<i4", -100, _INT32.max),
        ]
    )


def write_batches(path: Path, shape: Shape, steps: Iterable[StepBatch]) -> int:
    """Write every step to ``path`` atomically; returns the number of steps."""
    if shape.rows < 1 or shape.answer_len < 1 or shape.answer_len >= shape.seq_len:
        raise DataError(f"batches: bad shape {shape}")
    count = 0

    def write(handle: BinaryIO) -> None:
        nonlocal count
        handle.write(b"\0" * HEADER.size)  # rewritten once the step count is known
        for step in steps:
            handle.write(encode_step(shape, step))
            count += 1
        handle.seek(0)
        handle.write(HEADER.pack(MAGIC, shape.rows, shape.seq_len, shape.answer_len, count))

    atomic_write(Path(path), write)
    return count


def is_current(path: Path) -> bool:
    """Whether ``path`` starts with this format's magic (an older file is rebuilt, not read)."""
    with open(path, "rb") as handle:
        return handle.read(len(MAGIC)) == MAGIC


class BatchesFile:
    """Random access to the records of a batches file (memory-mapped, so opening a long run costs nothing)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        raw = np.memmap(self.path, dtype=np.uint8, mode="r") if self.path.stat().st_size else np.zeros(0, np.uint8)
        if raw.size < HEADER.size:
            raise DataError(f"{self.path}: too short for a batches file")
        magic, rows, seq_len, answer_len, steps = HEADER.unpack(raw[: HEADER.size].tobytes())
        if magic != MAGIC:
            raise DataError(f"{self.path}: not a mobizo batches file (bad magic)")
        self.shape = Shape(rows, seq_len, answer_len)
        self.steps = steps
        if raw.size != HEADER.size + steps * self.shape.record_size():
            raise DataError(f"{self.path}: size does not match its header ({steps} steps of {self.shape})")
        self._raw = raw.view(np.ndarray)  # a plain view of the mapping: slicing a np.memmap costs more per step

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, step: int) -> StepBatch:
        if not 0 <= step < self.steps:
            raise IndexError(f"{self.path}: no step {step} (it has {self.steps})")
        size, (rows, t, ans) = self.shape.record_size(), (self.shape.rows, self.shape.seq_len, self.shape.answer_len)
        record = self._raw[HEADER.size + step * size : HEADER.size + (step + 1) * size]
        cells = rows * t
        seed = int(record[:8].view("<i8")[0])
        lr = float(record[8:12].view("<f4")[0])
        head = STEP_HEAD.size
        ids = record[head : head + 4 * cells].view("<i4").reshape(rows, t)
        mask = record[head + 4 * cells : head + 5 * cells].reshape(rows, t)
        targets = record[head + 5 * cells :].view("<i4").reshape(rows, ans)
        return StepBatch(seed, lr, ids.astype(np.int64), mask.astype(np.int64), targets.astype(np.int64))
