"""The learning-rate schedule: the lr of step k of a run, the one function every backend and the server use.

``lr_at(lr, steps, k, schedule, warmup_steps, lr_floor)`` is computed in Python float64 and rounded once to
float32, the precision the program's update takes lr in; the result is a Python float whose repr round-trips
the float32 bits. The device writes it into each step's record of the batches file (``device_agent.batches``),
the eager loop (``shared.train``) feeds it to its step, every step's log line records it (``shared.train_log``),
and the server recomputes it for each logged step (``server.verify``): both sides call this function, so the
logged lr must equal it exactly.

Shapes, over a run of ``steps`` steps numbered from 0:

- warm-up: step k < ``warmup_steps`` runs at lr * (k + 1) / warmup_steps (linear, reaching lr at the last one);
- after it, with progress p = (k - warmup_steps) / max(1, steps - warmup_steps), which runs from 0 at the first
  step after warm-up to just below 1 at the last step:
  ``constant`` lr; ``linear`` lr * (f + (1 - f) * (1 - p)); ``cosine`` lr * (f + (1 - f) * (1 + cos(pi p)) / 2),
  where f = ``lr_floor`` is a FRACTION of lr in [0, 1] (the value approached as p -> 1; the last step stays above it).

A federated job's round part is a run of its own ``steps`` local steps, so the schedule restarts in every round.

Torch-free: the REST schemas and the server's request checks import it.
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Literal, get_args

import numpy as np

from shared import defaults
from shared.errors import UsageError

Schedule = Literal["constant", "linear", "cosine"]
SCHEDULES: tuple[str, ...] = get_args(Schedule)


def _count(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _number(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def check_schedule(
    steps: int,
    schedule: str = defaults.LR_SCHEDULE,
    warmup_steps: int = defaults.WARMUP_STEPS,
    lr_floor: float = defaults.LR_FLOOR,
) -> None:
    """``UsageError`` naming the field (``lr_schedule``, ``warmup_steps``, ``lr_floor``, ``steps``) that is wrong."""
    if schedule not in SCHEDULES:
        raise UsageError("lr_schedule", f"unknown schedule {schedule!r} (choose from {', '.join(SCHEDULES)})")
    if not _count(steps) or steps < 1:
        raise UsageError("steps", f"must be at least 1, got {steps!r}")
    if not _count(warmup_steps) or not 0 <= warmup_steps < steps:
        raise UsageError("warmup_steps", f"must be in [0, steps) = [0, {steps}), got {warmup_steps!r}")
    if not (_number(lr_floor) and 0 <= lr_floor <= 1):  # NaN fails both comparisons
        raise UsageError("lr_floor", f"must be a fraction of lr in [0, 1], got {lr_floor!r}")


def lr_at(
    lr: float,
    steps: int,
    k: int,
    schedule: str = defaults.LR_SCHEDULE,
    warmup_steps: int = defaults.WARMUP_STEPS,
    lr_floor: float = defaults.LR_FLOOR,
) -> float:
    """The float32 learning rate of step ``k`` (0-based) of a run of ``steps`` steps, as a Python float."""
    check_schedule(steps, schedule, warmup_steps, lr_floor)
    if not (_number(lr) and math.isfinite(lr) and lr > 0):
        raise UsageError("lr", f"must be a positive number, got {lr!r}")
    if not _count(k) or not 0 <= k < steps:
        raise UsageError("step", f"step {k!r} is not in [0, {steps})")
    lr, floor = float(lr), float(lr_floor)
    if k < warmup_steps:
        value = lr * (k + 1) / warmup_steps
    elif schedule == "constant":
        value = lr
    else:
        p = (k - warmup_steps) / max(1, steps - warmup_steps)
        shape = 1.0 - p if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))
        value = lr * (floor + (1.0 - floor) * shape)
    return float(np.float32(value))


def lrs(
    lr: float,
    steps: int,
    schedule: str = defaults.LR_SCHEDULE,
    warmup_steps: int = defaults.WARMUP_STEPS,
    lr_floor: float = defaults.LR_FLOOR,
) -> list[float]:
    """``lr_at`` of every step of the run, in order."""
    return [lr_at(lr, steps, k, schedule, warmup_steps, lr_floor) for k in range(steps)]
