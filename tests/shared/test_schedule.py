"""The learning-rate schedule: its values at the points that define it, float32 bits, and arguments it refuses."""

from __future__ import annotations

import math

import numpy as np
import pytest

from shared import defaults
from shared.errors import FieldError, UsageError
from shared.schedule import SCHEDULES, lr_at, lrs


def f32(x: float) -> float:
    return float(np.float32(x))


def test_warm_up_rises_linearly_to_lr_then_the_schedule_starts_at_lr() -> None:
    values = lrs(0.01, 20, "cosine", warmup_steps=4, lr_floor=0.1)
    assert (
        values[:4] == [f32(0.01 * (k + 1) / 4) for k in range(4)] == [f32(0.0025), f32(0.005), f32(0.0075), f32(0.01)]
    )
    assert values[4] == f32(0.01)  # cosine at p = 0 is lr
    assert all(a > b for a, b in zip(values[4:], values[5:]))  # then strictly decays


def test_cosine_ends_above_its_floor_and_approaches_it() -> None:
    lr, floor = 0.003, 0.2
    short = lrs(lr, 10, "cosine", lr_floor=floor)
    assert short[0] == f32(lr)
    p = 9 / 10
    assert short[-1] == f32(lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p))))
    assert short[-1] > f32(lr * floor)
    long = lr_at(lr, 100_000, 99_999, "cosine", lr_floor=floor)  # p -> 1
    assert long == f32(lr * floor)  # reached: within float32 rounding of the floor
    assert lr_at(lr, 100_000, 99_999, "cosine") == pytest.approx(0, abs=1e-12)  # floor 0: decays to nothing


def test_linear_decay_is_halfway_at_its_midpoint() -> None:
    # p = (k - warmup) / (steps - warmup) = 50 / 100 at k = 60 of 110 with 10 warm-up steps
    assert lr_at(0.004, 110, 60, "linear", warmup_steps=10) == f32(0.002)
    assert lr_at(0.004, 110, 60, "linear", warmup_steps=10, lr_floor=0.5) == f32(0.004 * 0.75)
    assert lr_at(0.004, 110, 60, "cosine", warmup_steps=10) == f32(0.002)  # cos(pi/2) = 0: cosine too


def test_constant_is_the_float32_lr_everywhere_after_warm_up() -> None:
    assert set(lrs(3e-3, 50, "constant", lr_floor=0.7)) == {f32(3e-3)}  # the floor does not apply
    assert lrs(3e-3, 5) == lrs(3e-3, 5, defaults.LR_SCHEDULE, defaults.WARMUP_STEPS, defaults.LR_FLOOR)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_values_are_float32_and_their_repr_round_trips(schedule: str) -> None:
    for value in lrs(1e-3, 37, schedule, warmup_steps=5, lr_floor=0.05):
        assert type(value) is float
        assert float(np.float32(value)) == value  # exactly a float32 value
        assert float(repr(value)) == value and np.float32(float(repr(value))).tobytes() == np.float32(value).tobytes()
        assert value > 0


def test_one_rounding_of_the_float64_value() -> None:
    """Not a float32 computation: the float64 value rounded once (what every side recomputes)."""
    k, steps, lr = 7, 13, 0.0123
    p = k / steps
    assert lr_at(lr, steps, k, "cosine") == float(np.float32(lr * 0.5 * (1 + math.cos(math.pi * p))))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"schedule": "step"}, "lr_schedule"),
        ({"warmup_steps": 10}, "warmup_steps"),  # must be below steps = 10
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"lr_floor": 1.5}, "lr_floor"),
        ({"lr_floor": -0.1}, "lr_floor"),
        ({"lr_floor": float("nan")}, "lr_floor"),
        ({"lr": 0.0}, "lr"),
        ({"lr": float("inf")}, "lr"),
        ({"steps": 0, "k": 0}, "steps"),
        ({"k": 10}, "step"),
        ({"k": -1}, "step"),
    ],
)
def test_bad_arguments_name_their_field(kwargs: dict, field: str) -> None:
    args = {"lr": 1e-3, "steps": 10, "k": 0} | kwargs
    with pytest.raises(UsageError) as caught:
        lr_at(**args)
    assert caught.value.field == field
    assert f"--{field.replace('_', '-')}" in str(caught.value)


def test_job_spec_checks_the_schedule_and_names_the_field() -> None:
    from pydantic import ValidationError

    from shared.errors import usage_error
    from shared.schemas import HyperParams

    spec = HyperParams(steps=10, lr=1e-3, lr_schedule="cosine", warmup_steps=2, lr_floor=0.1)
    assert (spec.lr_schedule, spec.warmup_steps, spec.lr_floor) == ("cosine", 2, 0.1)
    assert HyperParams().lr_schedule == defaults.LR_SCHEDULE
    for bad, field in (
        ({"warmup_steps": 10}, "warmup_steps"),
        ({"lr_floor": 2}, "lr_floor"),
        ({"lr_schedule": "exp"}, "lr_schedule"),
    ):
        with pytest.raises(ValidationError) as caught:
            HyperParams(steps=10, **bad)
        assert usage_error(caught.value).field == field
    with pytest.raises(ValidationError) as caught:
        HyperParams(steps=10, warmup_steps=10)
    assert isinstance(caught.value.errors()[0]["ctx"]["error"], FieldError)
    assert (
        "lr_schedule" in HyperParams.model_fields and "restarts" in HyperParams.model_fields["lr_schedule"].description
    )
