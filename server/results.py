"""Checks of an uploaded result that need no torch: sizes, the safetensors layout and values of B, metrics.

They run in the request (cheap, and they reject bad tensors before a worker is asked to replay). The log's checks
and the replay (``server.worker_tasks.verify_and_package``) run in a worker process.

Rejections raise ``ResultRejected(field, message)``: picklable, so a worker can raise it too, and turned into a
422 naming the part by the route.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from shared.errors import DataError
from shared.model_files import read_safetensors_header
from shared.schemas import B_FLAT_KEY, JobSpec

METRICS_LIMIT = 1 << 20
_LOG_LINE_BYTES = 512  # step, seed, lr, eps and punctuation, generously
_FLOAT_BYTES = 32  # one float written with repr() and a separator


class ResultRejected(ValueError):
    """An upload that is not a valid result for its job; nothing of it is stored."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(field, message)
        self.field = field
        self.message = message

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def b_size(manifest: dict[str, Any]) -> int:
    """D, the length of b_flat, as the program's manifest states it."""
    return int(manifest["lora_size"])


def b_limit(d: int) -> int:
    """Largest acceptable B file: the tensor plus a small header."""
    return 4 * d + 4096


def log_limit(spec: JobSpec) -> int:
    """Largest acceptable log: one line per step with 3q floats."""
    return spec.steps * (_LOG_LINE_BYTES + 3 * spec.q * _FLOAT_BYTES) + 4096


def check_b(path: Path, d: int) -> None:
    """Exactly one tensor ``b_flat``, float32, shape [D], every value finite."""
    try:
        header = read_safetensors_header(path)
    except DataError as exc:
        raise ResultRejected("b_flat", str(exc)) from None
    names = sorted(k for k in header if k != "__metadata__")
    if names != [B_FLAT_KEY]:
        raise ResultRejected("b_flat", f"expected one tensor named {B_FLAT_KEY!r}, got {names}")
    info = header[B_FLAT_KEY]
    if info.get("dtype") != "F32":
        raise ResultRejected("b_flat", f"dtype must be float32 (F32), got {info.get('dtype')}")
    if info.get("shape") != [d]:
        raise ResultRejected("b_flat", f"shape must be [{d}] for this job's program, got {info.get('shape')}")
    from safetensors.numpy import load_file

    try:
        values = load_file(str(path))[B_FLAT_KEY]
    except Exception as exc:  # safetensors raises its own error types for truncated or inconsistent files
        raise ResultRejected("b_flat", f"unreadable safetensors file ({exc})") from None
    if not np.isfinite(values).all():
        raise ResultRejected("b_flat", f"{int((~np.isfinite(values)).sum())} values are NaN or infinite")


def parse_metrics(data: bytes) -> dict[str, Any]:
    try:
        metrics = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ResultRejected("metrics", f"not JSON ({exc})") from None
    if not isinstance(metrics, dict):
        raise ResultRejected("metrics", "must be a JSON object")
    return metrics
