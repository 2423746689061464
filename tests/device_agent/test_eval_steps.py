"""Held-out measurements every K steps (``device_agent.job.eval_steps``, ``b_at_steps``): the points asked for, and
B at each rebuilt from the log in chunks bit for bit as a replay from the start would give it."""

from __future__ import annotations

import numpy as np
import torch

from device_agent.job import b_at_steps, eval_steps
from shared.noise import step_seed
from shared.replay import replay


def test_the_points_are_zero_every_k_and_the_last() -> None:
    assert eval_steps(20, None) == [0, 20]
    assert eval_steps(20, 8) == [0, 8, 16, 20]
    assert eval_steps(20, 10) == [0, 10, 20]
    assert eval_steps(5, 50) == [0, 5]


def test_b_at_each_point_is_the_replay_from_the_start_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    d, q, steps = 300, 2, 12
    records = [{"step": k, "seed": step_seed(7, k), "lr": 0.01, "g": rng.normal(size=q).tolist()} for k in range(steps)]
    init = rng.normal(size=d).astype(np.float32)
    points = eval_steps(steps, 5)
    got = dict(b_at_steps(init, records, points))
    assert list(got) == points
    for k in points:
        whole = replay(torch.from_numpy(init.copy()), records[:k]).numpy()
        assert np.array_equal(got[k], whole), k  # the same float32 updates in the same order: exact
    assert np.array_equal(got[0], init) and not np.array_equal(got[5], init)
