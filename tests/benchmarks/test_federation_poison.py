"""The benchmarks' lying client forges a log the server's checks accept: each g still follows from its losses."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.federation import _poison
from server.verify import _check_g
from shared.train_log import log_record


@pytest.mark.parametrize("factor", [1000.0, -1.0])
def test_a_poisoned_log_passes_the_g_check_and_carries_the_scaled_g(factor):
    rng = np.random.default_rng(0)
    eps = 0.01
    honest = []
    for step in range(5):
        losses = rng.uniform(4.0, 8.0, 8).astype(np.float32)
        g = (losses[0::2] - losses[1::2]) / (np.float32(eps) * np.float32(2))
        honest.append(log_record(step, step + 1, 0.05, eps, g, losses))
    for before, after in zip(honest, _poison(honest, factor), strict=True):
        _check_g(after, eps, f"step {after['step']}")  # raises ResultRejected if the server would refuse it
        assert min(after["losses"]) >= 0
        # the forged pair's difference is rounded once in float32: |l±| up to ~8 + 0.01·|g'| → a few ulps of that
        wanted = np.float32(factor) * np.asarray(before["g"], np.float32)
        tol = 4 * np.finfo(np.float32).eps * (np.abs(after["losses"]).max() / eps)
        assert np.allclose(after["g"], wanted, rtol=0, atol=tol)
        assert (np.sign(after["g"]) == np.sign(wanted)).all()
