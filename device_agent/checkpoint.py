"""Checkpoints and B files: what lets a killed run resume and end bit-identical to an uninterrupted one.

A training run is a pure function of (initial B, the batches file, lr, eps): each step's noise comes from its
seed and each step's data from its record. So a checkpoint needs only B after step k-1, the next step k, and
the job it belongs to (a checkpoint left by another job must never be resumed).

Checkpoint format (its one specification; ``runner/runner_io.cpp`` reads and writes the same bytes), all
integers little-endian:

    magic       8 bytes   b"MZCKPT01"
    next_step   uint64    the first step still to run
    job_len     uint32    length of the job id in bytes (at most 4096)
    job_id      job_len bytes, UTF-8
    d           uint64    number of B values
    b           float32[d]  b_flat (docs/contracts.md)

B files (the runner's ``--init-b`` and ``--out-b``) are raw little-endian float32, d values, no header.
Both are written atomically (temporary file, fsync, rename).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.errors import DataError
from shared.files import atomic_write_bytes

MAGIC = b"MZCKPT01"
MAX_JOB_ID_BYTES = 4096
_HEAD = struct.Struct("<8sQI")
_COUNT = struct.Struct("<Q")


@dataclass(frozen=True)
class Checkpoint:
    job_id: str
    next_step: int
    b: np.ndarray  # float32 [d]


def encode(ckpt: Checkpoint) -> bytes:
    job = ckpt.job_id.encode("utf-8")
    if len(job) > MAX_JOB_ID_BYTES:
        raise ValueError(f"job id longer than {MAX_JOB_ID_BYTES} bytes")
    b = np.asarray(ckpt.b, dtype="<f4").reshape(-1)
    return _HEAD.pack(MAGIC, ckpt.next_step, len(job)) + job + _COUNT.pack(b.size) + b.tobytes()


def decode(data: bytes, source: str = "checkpoint") -> Checkpoint:
    """Parse checkpoint bytes; ``DataError`` naming ``source`` when they are not a whole checkpoint."""
    if len(data) < _HEAD.size or data[:8] != MAGIC:
        raise DataError(f"{source}: not a mobizo checkpoint (bad magic)")
    _, next_step, job_len = _HEAD.unpack_from(data)
    if job_len > MAX_JOB_ID_BYTES or len(data) < _HEAD.size + job_len + _COUNT.size:
        raise DataError(f"{source}: truncated checkpoint")
    job_id = data[_HEAD.size : _HEAD.size + job_len].decode("utf-8")
    offset = _HEAD.size + job_len
    (d,) = _COUNT.unpack_from(data, offset)
    if len(data) - offset - _COUNT.size != 4 * d:
        raise DataError(f"{source}: B length does not match the file size")
    b = np.frombuffer(data, dtype="<f4", count=d, offset=offset + _COUNT.size).astype(np.float32)
    return Checkpoint(job_id=job_id, next_step=next_step, b=b)


def save_checkpoint(path: Path, ckpt: Checkpoint) -> None:
    atomic_write_bytes(Path(path), encode(ckpt))


def load_checkpoint(path: Path, job_id: str) -> Checkpoint | None:
    """The checkpoint at ``path`` for ``job_id``; None when there is none or it belongs to another job."""
    path = Path(path)
    if not path.exists():
        return None
    ckpt = decode(path.read_bytes(), str(path))
    return ckpt if ckpt.job_id == job_id else None


def save_b(path: Path, b: np.ndarray) -> None:
    atomic_write_bytes(Path(path), np.asarray(b, dtype="<f4").reshape(-1).tobytes())


def load_b(path: Path) -> np.ndarray:
    data = Path(path).read_bytes()
    if len(data) % 4:
        raise DataError(f"{path}: size is not a multiple of 4 (raw float32 expected)")
    return np.frombuffer(data, dtype="<f4").astype(np.float32)
