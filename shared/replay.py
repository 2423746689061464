"""Replaying a training log (``shared.train_log``): B rebuilt from the initial B and every step's (seed, lr, g).

Because z is a pure function of the step's seed (``shared.noise``) and the update is the same float32 arithmetic
as in the program (``shared.zo_optim.update``), replaying a device's log gives the device's B bit for bit. The
server uses it to verify uploads, a device to resume and to measure its held-out points; anyone can use it to audit
a trajectory without the data.

The replay is NumPy's (``shared.noise.step_noise_np`` and the update on float32 arrays), so a device without torch
runs it; it gives the bits of the torch step (tests/shared/test_replay_numpy.py) and draws the noise several times
faster than torch's int64 kernels. A caller holding torch tensors gets torch tensors back.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shared.noise import step_noise_np
from shared.zo_optim import new_state_np, step_bound, update

# What the float32 update may add to an exact bound: a relative rounding of the step itself, and one rounding of B.
BOUND_RTOL, B_ULPS = 1e-5, 2.0**-22


class OutOfBounds(ValueError):
    """A replayed step moved B further than its optimizer's bound (``shared.zo_optim.step_bound``)."""


def replay(init_b: Any, log: list[dict], optimizer: str = "sgd") -> Any:
    """B after every step of ``log``, starting from ``init_b`` (flat float32), moved by ``optimizer``
    (``shared.zo_optim``: its state starts at zero and is rebuilt from the logged g; a log written before there were
    optimizers is an ``sgd`` log)."""
    return replay_state(init_b, log, optimizer)[0]


def replay_state(
    init_b: Any,
    log: list[dict],
    optimizer: str = "sgd",
    state: dict[str, Any] | None = None,
    check: bool = False,
) -> tuple[Any, dict[str, Any]]:
    """(B, optimizer state) after ``log``, from ``init_b`` and ``state`` (None: the optimizer's initial state).
    ``check``: every step's largest move of a coordinate must be within the optimizer's bound, or ``OutOfBounds``
    (the server's verification). ``init_b`` and ``state`` are NumPy arrays or torch tensors; what comes back is of
    the kind ``init_b`` is (the arithmetic is float32 NumPy either way)."""
    b = _float32(init_b)
    state = new_state_np(optimizer, b.shape[0]) if state is None else {k: _float32(v) for k, v in state.items()}
    carried = max((float(np.abs(t).max()) for t in state.values() if t.size), default=0.0)
    for record in log:
        g = np.asarray(record["g"], dtype=np.float32)
        z = step_noise_np(int(record["seed"]), g.shape[0], b.shape[0])
        before = b
        b, state = update(optimizer, b, z, g, np.asarray([record["lr"]], dtype=np.float32), state)
        if check:
            bound, carried = step_bound(optimizer, float(record["lr"]), record["g"], carried)
            _within(before, b, bound, record.get("step"), optimizer)
    if isinstance(init_b, np.ndarray):
        return b, state
    import torch

    return torch.from_numpy(b), {k: torch.from_numpy(v) for k, v in state.items()}


def _float32(values: Any) -> np.ndarray:
    """A float32 copy of an array or a (CPU or accelerator) tensor."""
    if not isinstance(values, np.ndarray):
        values = values.detach().cpu().numpy()
    return np.array(values, dtype=np.float32)


def _within(before: np.ndarray, after: np.ndarray, bound: float, step, optimizer: str) -> None:
    moved = float(np.abs(after - before).max())
    # B's rounding: at most an ulp of the larger of |B| before and after, and |after| <= |before| + bound
    slack = BOUND_RTOL * bound + B_ULPS * (float(np.abs(before).max()) + bound)
    if not moved <= bound + slack:  # NaN and an overflow to infinity fail too
        raise OutOfBounds(f"step {step}: B moved by {moved:.6g}, more than {optimizer}'s bound {bound:.6g}")
