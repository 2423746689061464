"""Checkpoints and B files: exact bytes back, the right job only, damage detected."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from device_agent.checkpoint import Checkpoint, decode, encode, load_b, load_checkpoint, save_b, save_checkpoint
from shared.errors import DataError


def test_round_trip_is_bit_exact(tmp_path: Path) -> None:
    b = np.array([0.1, -0.0, np.float32(1e-38), 3.4e38, np.nan], dtype=np.float32)
    save_checkpoint(tmp_path / "c", Checkpoint("job-7", 12, b))
    got = load_checkpoint(tmp_path / "c", "job-7")
    assert got is not None and (got.job_id, got.next_step) == ("job-7", 12)
    assert got.b.dtype == np.float32
    assert got.b.tobytes() == b.tobytes()  # byte equality also covers -0.0 and NaN
    assert [p.name for p in tmp_path.iterdir()] == ["c"]  # no temporary file left behind


def test_layout_is_the_documented_one() -> None:
    data = encode(Checkpoint("ab", 3, np.array([1.5], dtype=np.float32)))
    assert data == b"MZCKPT01" + struct.pack("<QI", 3, 2) + b"ab" + struct.pack("<Qf", 1, 1.5)


def test_other_jobs_and_missing_files_give_none(tmp_path: Path) -> None:
    save_checkpoint(tmp_path / "c", Checkpoint("job-1", 1, np.zeros(2, np.float32)))
    assert load_checkpoint(tmp_path / "c", "job-2") is None
    assert load_checkpoint(tmp_path / "missing", "job-1") is None


@pytest.mark.parametrize("cut", [1, 4, 12, 30])
def test_truncated_checkpoint_is_an_error(cut: int) -> None:
    data = encode(Checkpoint("job", 1, np.ones(4, np.float32)))
    with pytest.raises(DataError):
        decode(data[:-cut])


def test_b_file_is_raw_float32(tmp_path: Path) -> None:
    b = np.arange(6, dtype=np.float32) / 7
    save_b(tmp_path / "b.f32", b)
    assert (tmp_path / "b.f32").read_bytes() == b.astype("<f4").tobytes()
    np.testing.assert_array_equal(load_b(tmp_path / "b.f32"), b)
    (tmp_path / "bad.f32").write_bytes(b"\0" * 5)
    with pytest.raises(DataError, match="multiple of 4"):
        load_b(tmp_path / "bad.f32")
