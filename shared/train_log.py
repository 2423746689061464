"""The training log: one JSON line per step, ``{"step", "seed", "lr", "eps", "g", "losses"}`` (docs/contracts.md).

Floats are float32 values written as Python floats, whose repr round-trips the float32 bits exactly, so a replay
(``shared.replay``) of the log rebuilds B bit for bit. Torch-free: the device writes it, the server checks it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from shared.errors import DataError

LOG_FIELDS = ("step", "seed", "lr", "eps", "g", "losses")


def _f32(values) -> list[float]:
    """float32 values as Python floats: their repr round-trips the float32 bits exactly."""
    return [float(v) for v in np.asarray(values, dtype=np.float32).reshape(-1)]


def log_record(step: int, seed: int, lr: float, eps: float, g, losses) -> dict:
    return {"step": step, "seed": int(seed), "lr": lr, "eps": eps, "g": _f32(g), "losses": _f32(losses)}


def log_line(record: dict) -> str:
    return json.dumps(record, separators=(",", ":")) + "\n"


def parse_log(text: str, source: str = "log") -> list[dict]:
    """Parse and check a training log: consecutive steps, q projected gradients each, all finite."""
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{source}:{number}: not JSON ({exc.msg})") from exc
        missing = [f for f in LOG_FIELDS if not isinstance(record, dict) or f not in record]
        if missing:
            raise DataError(f"{source}:{number}: missing {', '.join(missing)}")
        if records and record["step"] != records[-1]["step"] + 1:
            raise DataError(f"{source}:{number}: step {record['step']} does not follow {records[-1]['step']}")
        if not record["g"] or len(record["g"]) != len(records[0]["g"] if records else record["g"]):
            raise DataError(f"{source}:{number}: g must hold the same number q >= 1 of values on every line")
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in [record["lr"], *record["g"]]):
            raise DataError(f"{source}:{number}: lr and g must be finite numbers")
        records.append(record)
    if not records:
        raise DataError(f"{source}: empty training log")
    return records


def read_log(path: Path) -> list[dict]:
    return parse_log(Path(path).read_text(), str(path))
