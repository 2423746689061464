"""The batches file: what the host writes is what every backend reads, and nothing else is accepted."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from device_agent.batches import HEADER, BatchesFile, Shape, StepBatch, fit_width, is_current, write_batches
from shared.errors import DataError
from shared.schedule import lr_at
from tests.device_agent.helpers import LR, random_steps

SHAPE = Shape(rows=4, seq_len=8, answer_len=2)


def test_round_trip_keeps_every_value(tmp_path: Path) -> None:
    lrs = lr_at_each(5)
    steps = random_steps(SHAPE, 50, 5, lrs=lrs)
    path = tmp_path / "b.mzb"
    assert write_batches(path, SHAPE, steps) == 5
    read = BatchesFile(path)
    assert (len(read), read.shape) == (5, SHAPE)
    for want, got in zip(steps, [read[k] for k in range(5)], strict=True):
        assert got.seed == want.seed
        assert np.float32(got.lr).tobytes() == np.float32(want.lr).tobytes() and got.lr == want.lr  # bit for bit
        for name in ("input_ids", "attention_mask", "targets"):
            assert getattr(got, name).dtype == np.int64
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name))


def test_records_have_the_documented_size(tmp_path: Path) -> None:
    path = tmp_path / "b.mzb"
    write_batches(path, SHAPE, random_steps(SHAPE, 50, 3))
    # 8 (seed) + 4 (lr) + 4 (reserved) + 4*32 (ids) + 32 (mask) + 4*8 (targets) = 208 bytes a record, after a
    # 32-byte header: every record starts 8-byte aligned.
    assert HEADER.size == 32
    assert path.stat().st_size == 32 + 3 * 208
    data = path.read_bytes()
    assert data[:8] == b"MZBATCH2"
    for k in range(3):
        head = data[32 + k * 208 : 32 + k * 208 + 16]
        assert struct.unpack("<f", head[8:12])[0] == np.float32(LR) and head[12:16] == b"\0" * 4


def lr_at_each(steps: int) -> list[float]:
    """A schedule whose every step has its own lr, none of them round in binary."""
    return [lr_at(0.003, steps, k, "cosine", warmup_steps=1, lr_floor=0.05) for k in range(steps)]


def test_schedule_survives_the_file_bit_for_bit(tmp_path: Path) -> None:
    lrs = [lr_at(1e-3, 1000, k, "cosine", 100, 0.1) for k in range(1000)]
    steps = random_steps(Shape(rows=1, seq_len=3, answer_len=1), 50, 1000, lrs=lrs)
    path = tmp_path / "b.mzb"
    write_batches(path, Shape(rows=1, seq_len=3, answer_len=1), steps)
    read = BatchesFile(path)
    assert [read[k].lr for k in range(1000)] == lrs
    assert np.asarray(lrs, np.float32).tobytes() == np.asarray([read[k].lr for k in range(1000)], np.float32).tobytes()


@pytest.mark.parametrize("lr", [0.1, 0.0, -np.float32(0.5).item(), float("nan"), float("inf")])
def test_lr_that_is_not_a_positive_float32_is_refused(tmp_path: Path, lr: float) -> None:
    """0.1 is not a float32 value: a writer that forgot to round would store other bits than it logs."""
    bad = StepBatch(**{**random_steps(SHAPE, 50, 1)[0].__dict__, "lr": lr})
    with pytest.raises(DataError, match="lr"):
        write_batches(tmp_path / "b.mzb", SHAPE, [bad])
    assert list(tmp_path.iterdir()) == []


def test_a_file_of_the_old_format_is_refused_and_known_as_old(tmp_path: Path) -> None:
    path = tmp_path / "b.mzb"
    write_batches(path, SHAPE, random_steps(SHAPE, 50, 1))
    assert is_current(path)
    path.write_bytes(b"MZBATCH1" + path.read_bytes()[8:])
    assert not is_current(path)
    with pytest.raises(DataError, match="magic"):
        BatchesFile(path)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("input_ids", np.zeros((4, 7)), "shape"),
        ("attention_mask", np.full((4, 8), 2), "outside"),
        ("targets", np.full((4, 2), -101), "outside"),
        ("input_ids", np.full((4, 8), -1), "outside"),
    ],
)
def test_bad_step_is_refused_and_leaves_no_file(tmp_path: Path, field: str, value: np.ndarray, message: str) -> None:
    good = random_steps(SHAPE, 50, 1)[0]
    bad = StepBatch(**{**good.__dict__, field: value})
    path = tmp_path / "b.mzb"
    with pytest.raises(DataError, match=message):
        write_batches(path, SHAPE, [good, bad])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("damage", ["truncate", "magic", "empty"])
def test_damaged_file_is_refused(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "b.mzb"
    write_batches(path, SHAPE, random_steps(SHAPE, 50, 2))
    data = path.read_bytes()
    path.write_bytes({"truncate": data[:-1], "magic": b"X" + data[1:], "empty": b""}[damage])
    with pytest.raises(DataError):
        BatchesFile(path)


def test_step_index_is_checked(tmp_path: Path) -> None:
    path = tmp_path / "b.mzb"
    write_batches(path, SHAPE, random_steps(SHAPE, 50, 2))
    with pytest.raises(IndexError):
        BatchesFile(path)[2]


def test_a_batch_is_fitted_to_its_longest_row() -> None:
    """``fit_width``: the leading columns that are padding in every row are cut down to the program's narrowest
    width; a narrower batch is padded up to it; a program of one width takes the batch as it is."""
    ids = np.arange(1, 25).reshape(3, 8)
    mask = np.zeros_like(ids)
    mask[0, 5:], mask[1, 3:], mask[2, 6:] = 1, 1, 1  # the longest row: 5 tokens
    got_ids, got_mask = fit_width(ids, mask, (3, 8))
    assert np.array_equal(got_ids, ids[:, 3:]) and np.array_equal(got_mask, mask[:, 3:])
    assert fit_width(ids, mask, (6, 8))[0].shape == (3, 6)  # at least the narrowest
    assert fit_width(ids, mask, None)[0] is ids
    narrow_ids, narrow_mask = fit_width(ids[:, 6:], mask[:, 6:], (3, 8))  # two columns, the program takes three
    assert np.array_equal(narrow_ids, np.pad(ids[:, 6:], ((0, 0), (1, 0))))
    assert np.array_equal(narrow_mask[:, 0], np.zeros(3)) and np.array_equal(narrow_mask[:, 1:], mask[:, 6:])
    with pytest.raises(DataError, match="5 tokens does not fit the program's 4 columns"):
        fit_width(ids, mask, (3, 4))
