"""Aggregating a round (``shared.aggregate``): each rule's definition, float32 throughout, the same bits for the
same inputs in the same order, and what a poisoned client does to each rule."""

from __future__ import annotations

import numpy as np
import pytest

from shared.aggregate import aggregate, next_global_b, trimmed_count

pytestmark = pytest.mark.numerics  # CI runs these again on ATen's portable kernels (.ci/run)


def _deltas(n: int, d: int = 64, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(d).astype(np.float32) * np.float32(1e-3) for _ in range(n)]


def test_fedavg_is_the_left_to_right_sum_over_n_in_float32():
    deltas = _deltas(5)
    expected = ((((deltas[0] + deltas[1]) + deltas[2]) + deltas[3]) + deltas[4]) / np.float32(5)
    got = aggregate(deltas, "fedavg")
    assert got.dtype == np.float32 and np.array_equal(got.view(np.int32), expected.view(np.int32))
    again = aggregate([d.copy() for d in deltas], "fedavg")
    assert np.array_equal(got.view(np.int32), again.view(np.int32))


def test_median_and_trimmed_mean_per_coordinate():
    deltas = [np.array([v, -v], np.float32) for v in (3.0, 1.0, 2.0, 100.0)]
    assert aggregate(deltas, "median").tolist() == [2.5, -2.5]  # mean of the two middle values
    assert aggregate(deltas[:3], "median").tolist() == [2.0, -2.0]
    assert trimmed_count(4, 0.25) == 1 and trimmed_count(4, 0.49) == 1 and trimmed_count(3, 0.49) == 1
    assert trimmed_count(2, 0.49) == 0  # at least one value is always kept
    assert aggregate(deltas, "trimmed-mean", 0.25).tolist() == [2.5, -2.5]
    assert aggregate(deltas, "trimmed-mean", 0.0).tolist() == aggregate(deltas, "fedavg").tolist()


def test_a_poisoned_client_moves_fedavg_but_not_median_or_trimmed_mean():
    honest = _deltas(4, seed=1)
    poisoned = honest + [honest[0] * np.float32(-1000)]  # sign-flipped and scaled
    clean = aggregate(honest, "median")
    bound = float(np.abs(np.stack(honest)).max())
    assert float(np.abs(aggregate(poisoned, "fedavg")).max()) > 100 * bound
    for method in ("median", "trimmed-mean"):
        assert float(np.abs(aggregate(poisoned, method, 0.2)).max()) <= bound
    assert float(np.abs(clean).max()) <= bound


def test_next_global_b_is_b_plus_eta_times_the_aggregate():
    b_r = np.linspace(-1, 1, 64, dtype=np.float32)
    clients = [b_r + d for d in _deltas(3, seed=2)]
    b_next, update = next_global_b(b_r, clients, "fedavg", 0.0, 0.5)
    deltas = [c - b_r for c in clients]
    expected = b_r + np.float32(0.5) * (((deltas[0] + deltas[1]) + deltas[2]) / np.float32(3))
    assert np.array_equal(b_next.view(np.int32), expected.view(np.int32)) and b_next.dtype == np.float32
    with pytest.raises(ValueError, match="no client"):
        aggregate([], "fedavg")
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(deltas, "mean")


def test_server_momentum_adds_beta_times_the_last_rounds_momentum():
    b_r = np.linspace(-1, 1, 64, dtype=np.float32)
    clients = [b_r + d for d in _deltas(3, seed=4)]
    m_r = np.linspace(0.5, -0.25, 64, dtype=np.float32)
    b_next, m_next = next_global_b(b_r, clients, "median", 0.0, 0.5, 0.9, m_r)
    median = aggregate([c - b_r for c in clients], "median")
    assert m_next.tobytes() == (np.float32(0.9) * m_r + median).tobytes()
    assert b_next.tobytes() == (b_r + np.float32(0.5) * m_next).tobytes()
    first, m_first = next_global_b(b_r, clients, "median", 0.0, 0.5, 0.9)  # round 0: m_r is zeros
    assert m_first.tobytes() == median.tobytes() and first.tobytes() == (b_r + np.float32(0.5) * median).tobytes()
    plain = next_global_b(b_r, clients, "median", 0.0, 0.5, 0.0, m_r)  # BETA 0: FedAvg's rule, m_r unused
    assert plain[0].tobytes() == first.tobytes()
