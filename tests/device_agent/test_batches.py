"""The batches file: what the host writes is what every backend reads, and nothing else is accepted."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from device_agent.batches import HEADER, BatchesFile, Shape, StepBatch, write_batches
from shared.errors import DataError
from tests.device_agent.helpers import random_steps

SHAPE = Shape(rows=4, seq_len=8, answer_len=2)


def test_round_trip_keeps_every_value(tmp_path: Path) -> None:
    steps = random_steps(SHAPE, 50, 5)
    path = tmp_path / "b.mzb"
    assert write_batches(path, SHAPE, steps) == 5
    read = BatchesFile(path)
    assert (len(read), read.shape) == (5, SHAPE)
    for want, got in zip(steps, [read[k] for k in range(5)]):
        assert got.seed == want.seed
        for name in ("input_ids", "attention_mask", "targets"):
            assert getattr(got, name).dtype == np.int64
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name))


def test_records_have_the_documented_size(tmp_path: Path) -> None:
    path = tmp_path / "b.mzb"
    write_batches(path, SHAPE, random_steps(SHAPE, 50, 3))
    # 8 (seed) + 4*32 (ids) + 32 (mask) + 4*8 (targets) = 200 bytes a record, after a 32-byte header.
    assert HEADER.size == 32
    assert path.stat().st_size == 32 + 3 * 200
    assert path.read_bytes()[:8] == b"MZBATCH1"


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
