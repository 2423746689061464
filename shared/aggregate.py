"""Aggregating a federated round, bit-reproducibly: the clients' deltas (each the replay of its log from B_r, minus
B_r), combined coordinate-wise in float32 in a fixed order, and the next global B.

Every operation is an IEEE float32 elementwise add, subtract, multiply or divide (or a sort), applied in the order
written here — sums run left to right over the clients in the order given — so the same inputs give the same bits
on every machine: the round's B can be recomputed offline from the accepted logs. NumPy only (the server's request
path imports it without torch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

AGGREGATIONS = ("fedavg", "trimmed-mean", "median")


def _sum_left_to_right(rows: Sequence[np.ndarray]) -> np.ndarray:
    total = np.array(rows[0], dtype=np.float32, copy=True)
    for row in rows[1:]:
        total = total + row
    return total


def trimmed_count(n: int, trim_fraction: float) -> int:
    """How many values trimmed-mean cuts at each end of n: floor(F·n), leaving at least one."""
    return min(math.floor(trim_fraction * n), (n - 1) // 2)


def aggregate(deltas: Sequence[np.ndarray], method: str, trim_fraction: float = 0.0) -> np.ndarray:
    """Combine the clients' deltas (float32 [D] each, in the round's client order) coordinate-wise.

    fedavg: their plain mean (every client ran the same local steps on the same batch size). trimmed-mean: per
    coordinate, drop the ``trimmed_count`` smallest and largest values and average the rest (in sorted order).
    median: per coordinate, the middle value, or the mean of the two middle ones.
    """
    if not deltas:
        raise ValueError("no client deltas to aggregate")
    if method not in AGGREGATIONS:
        raise ValueError(f"aggregation {method!r} is not one of {', '.join(AGGREGATIONS)}")
    n = len(deltas)
    if method == "fedavg":
        return _sum_left_to_right(deltas) / np.float32(n)
    ordered = np.sort(np.stack(deltas).astype(np.float32), axis=0, kind="stable")
    if method == "trimmed-mean":
        cut = trimmed_count(n, trim_fraction)
        kept = ordered[cut : n - cut]
        return _sum_left_to_right(list(kept)) / np.float32(len(kept))
    if n % 2:
        return ordered[n // 2].copy()
    return (ordered[n // 2 - 1] + ordered[n // 2]) / np.float32(2)


def staleness_weight(staleness: int) -> np.float32:
    """A buffered part's weight: 1/sqrt(1 + s) for a part leased s versions before the one it is aggregated into
    (FedBuff's rule, Nguyen et al. 2022), in float32; 1 for a fresh part."""
    return np.float32(1) / np.sqrt(np.float32(1 + staleness))


def next_global_b(
    b_r: np.ndarray,
    client_bs: Sequence[np.ndarray],
    method: str,
    trim_fraction: float,
    eta: float,
    momentum: float = 0.0,
    m_r: np.ndarray | None = None,
    starts: Sequence[np.ndarray] | None = None,
    staleness: Sequence[int] | None = None,
):
    """B_{r+1} = B_r + ETA·m_{r+1} with m_{r+1} = BETA·m_r + aggregate(B_i − B_r) → (B_{r+1}, m_{r+1}), all float32.

    ``momentum`` BETA = 0 (the default) is FedAvg and its relatives: m_{r+1} is the round's aggregate alone. BETA > 0
    is server-side momentum over rounds (FedAvgM, Hsu et al. 2019): the server keeps m (``m_r``, None: zeros before
    the first round). The aggregates are the server's own data (the replays of the clients' logs), so momentum
    across rounds needs nothing from the devices; each client runs its round as a fresh run from B_r.

    Buffered rounds: each part started from the version it leased (``starts``: B_{v_i}, default B_r for all), and
    its delta B_i − B_{v_i} is scaled by ``staleness_weight(s_i)`` (``staleness``: s_i = r − v_i) before the
    aggregation; with every s_i = 0 the bits are those of the synchronous rule.
    """
    b_r = np.asarray(b_r, dtype=np.float32)
    starts = [b_r] * len(client_bs) if starts is None else [np.asarray(s, dtype=np.float32) for s in starts]
    deltas = [np.asarray(b, dtype=np.float32) - start for b, start in zip(client_bs, starts, strict=True)]
    if staleness is not None:
        deltas = [delta * staleness_weight(s) for delta, s in zip(deltas, staleness, strict=True)]
    update = aggregate(deltas, method, trim_fraction)
    if momentum:
        m_prev = np.zeros_like(update) if m_r is None else np.asarray(m_r, dtype=np.float32)
        update = np.float32(momentum) * m_prev + update
    return b_r + np.float32(eta) * update, update
