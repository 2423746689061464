"""The training log: one JSON line per step, ``{"step", "seed", "lr", "eps", "g", "losses"}`` (docs/contracts.md);
a private run's (``shared.privacy``) holds no ``losses`` and no key but these five: its g are privatized, and nothing
else of the data leaves (the log is stored as sent, so a line with any other key is refused).

Floats are float32 values written as Python floats, whose repr round-trips the float32 bits exactly, so a replay
(``shared.replay``) of the log rebuilds B bit for bit. Torch-free: the device writes it, the server checks it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from shared.errors import DataError

LOG_FIELDS = ("step", "seed", "lr", "eps", "g", "losses")
PRIVATE_LOG_FIELDS = LOG_FIELDS[:-1]
_MAX_COUNT = 2**31 - 1  # steps and seeds are 32-bit (``shared.noise.MAX_SEED``, ``HyperParams.steps``)


def _f32(values) -> list[float]:
    """float32 values as Python floats: their repr round-trips the float32 bits exactly."""
    return [float(v) for v in np.asarray(values, dtype=np.float32).reshape(-1)]


def log_record(step: int, seed: int, lr: float, eps: float, g, losses) -> dict:
    """One step's line; ``losses`` None: a private step's, without them."""
    record = {"step": step, "seed": int(seed), "lr": lr, "eps": eps, "g": _f32(g)}
    return record if losses is None else record | {"losses": _f32(losses)}


def log_line(record: dict) -> str:
    return json.dumps(record, separators=(",", ":")) + "\n"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_F32_OVERFLOW = 2.0**128 - 2.0**103  # float32(x) is infinite from here on (FLT_MAX plus half an ulp, rounded up)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_float32(value: object) -> bool:
    """A JSON number a float32 holds as a finite value: not NaN or ±Infinity, no integer of hundreds of digits (which
    ``float()`` cannot even convert), no float beyond float32's range; what the replay and the checks compute with."""
    if not _is_number(value):
        return False
    try:
        return abs(float(value)) < _F32_OVERFLOW  # False for NaN too
    except OverflowError:
        return False


def _type_problem(record: dict) -> str | None:
    """Why a record's fields are not of their types (step and seed 32-bit counts; lr, eps, each g and each loss a
    finite float32 number), so that every later check compares numbers; None when they are."""
    for key in ("step", "seed"):
        if not _is_int(record[key]) or not 0 <= record[key] <= _MAX_COUNT:
            return f"{key} must be an integer in [0, 2**31)"
    for key in ("lr", "eps"):
        if not _is_float32(record[key]):
            return f"{key} must be a finite float32 number"
    for key in ("g", "losses")[: 2 if "losses" in record else 1]:
        if not isinstance(record[key], list) or not all(_is_float32(v) for v in record[key]):
            return f"{key} must be a list of finite float32 numbers"
    return None


def parse_log(text: str, source: str = "log", private: bool = False) -> list[dict]:
    """Parse and check a training log: fields of their types, consecutive steps, q projected gradients each;
    ``private``: a private run's, whose lines must hold no losses.

    Every malformed line raises ``DataError`` naming the line: what a device uploads is parsed here first.
    """
    fields = PRIVATE_LOG_FIELDS if private else LOG_FIELDS
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as exc:  # ValueError: JSONDecodeError, or an integer of 4,300+ digits
            if isinstance(exc, json.JSONDecodeError):
                reason = exc.msg
            elif isinstance(exc, RecursionError):
                reason = "nested too deep"
            else:
                reason = "a number too long to read"
            raise DataError(f"{source}:{number}: not JSON ({reason})") from None
        missing = [f for f in fields if not isinstance(record, dict) or f not in record]
        if missing:
            raise DataError(f"{source}:{number}: missing {', '.join(missing)}")
        if private and "losses" in record:
            raise DataError(f"{source}:{number}: a private log holds no losses")
        if private and len(record) != len(PRIVATE_LOG_FIELDS):  # its five fields are there: another key is too
            fields = ", ".join(PRIVATE_LOG_FIELDS)
            raise DataError(f"{source}:{number}: a private log's lines hold {fields} and nothing else")
        problem = _type_problem(record)
        if problem:
            raise DataError(f"{source}:{number}: {problem}")
        if records and record["step"] != records[-1]["step"] + 1:
            raise DataError(f"{source}:{number}: step {record['step']} does not follow {records[-1]['step']}")
        if not record["g"] or len(record["g"]) != len(records[0]["g"] if records else record["g"]):
            raise DataError(f"{source}:{number}: g must hold the same number q >= 1 of values on every line")
        records.append(record)
    if not records:
        raise DataError(f"{source}: empty training log")
    return records


def read_log(path: Path, private: bool | None = False) -> list[dict]:
    """``parse_log`` of a file; ``private`` None: whichever kind its first line is (``mobizo replay`` replays
    both), every line then of that kind."""
    text = Path(path).read_text()
    if private is None:
        first = text.lstrip().split("\n", 1)[0]
        private = '"losses"' not in first
    return parse_log(text, str(path), private)


def step_losses(log: list[dict]) -> list[float] | None:
    """Each step's mean path loss (``metrics.json``'s ``losses``); None for a private log, which has no losses. The
    device reports these and the server stores its own, from the verified log (``server.verify``)."""
    if any("losses" not in record for record in log):
        return None
    return [float(np.mean(record["losses"])) for record in log]
