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

from shared.b_file import read_b_file
from shared.errors import DataError
from shared.manifest import ProgramManifest
from shared.schemas import JobSpec

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
    return ProgramManifest.model_validate(manifest).lora_size


def b_limit(d: int) -> int:
    """Largest acceptable B file: the tensor plus a small header."""
    return 4 * d + 4096


def log_limit(spec: JobSpec) -> int:
    """Largest acceptable log: one line per step with 3q floats."""
    return spec.steps * (_LOG_LINE_BYTES + 3 * spec.q * _FLOAT_BYTES) + 4096


def check_b(path: Path, d: int) -> None:
    """A B file (``shared.b_file``): exactly one tensor ``b_flat``, float32, shape [D], every value finite."""
    try:
        read_b_file(path, d)
    except DataError as exc:
        raise ResultRejected("b_flat", str(exc)) from None


def parse_metrics(data: bytes) -> dict[str, Any]:
    try:
        metrics = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ResultRejected("metrics", f"not JSON ({exc})") from None
    if not isinstance(metrics, dict):
        raise ResultRejected("metrics", "must be a JSON object")
    return metrics
