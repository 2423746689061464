"""Replaying a training log (``shared.train_log``): B rebuilt from the initial B and every step's (seed, lr, g).

Because z is a pure function of the step's seed (``shared.noise``) and the update is the same float32 arithmetic
as in the program (``shared.zo.updated_b``), replaying a device's log gives the device's B bit for bit. The
server uses it to verify uploads; anyone can use it to audit a trajectory without the data.
"""

from __future__ import annotations

import torch

from shared.zo import step_noise
from shared.zo_optim import new_state, step_bound, update

# What the float32 update may add to an exact bound: a relative rounding of the step itself, and one rounding of B.
BOUND_RTOL, B_ULPS = 1e-5, 2.0**-22


class OutOfBounds(ValueError):
    """A replayed step moved B further than its optimizer's bound (``shared.zo_optim.step_bound``)."""


def replay(init_b: torch.Tensor, log: list[dict], optimizer: str = "sgd") -> torch.Tensor:
    """B after every step of ``log``, starting from ``init_b`` (flat float32), moved by ``optimizer``
    (``shared.zo_optim``: its state starts at zero and is rebuilt from the logged g; a log written before there were
    optimizers is an ``sgd`` log)."""
    return replay_state(init_b, log, optimizer)[0]


def replay_state(
    init_b: torch.Tensor,
    log: list[dict],
    optimizer: str = "sgd",
    state: dict[str, torch.Tensor] | None = None,
    check: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(B, optimizer state) after ``log``, from ``init_b`` and ``state`` (None: the optimizer's initial state).
    ``check``: every step's largest move of a coordinate must be within the optimizer's bound, or ``OutOfBounds``
    (the server's verification)."""
    b = init_b.detach().to(torch.float32).clone()
    state = new_state(optimizer, b.shape[0]) if state is None else state
    carried = max((float(t.abs().max()) for t in state.values() if t.numel()), default=0.0)
    with torch.no_grad():
        for record in log:
            g = torch.tensor(record["g"], dtype=torch.float32)
            z = step_noise(torch.tensor([int(record["seed"])]), g.shape[0], b.shape[0])
            before = b
            b, state = update(optimizer, b, z, g, torch.tensor([record["lr"]], dtype=torch.float32), state)
            if check:
                bound, carried = step_bound(optimizer, float(record["lr"]), record["g"], carried)
                _within(before, b, bound, record.get("step"), optimizer)
    return b, state


def _within(before: torch.Tensor, after: torch.Tensor, bound: float, step, optimizer: str) -> None:
    moved = float((after - before).abs().max())
    # B's rounding: at most an ulp of the larger of |B| before and after, and |after| <= |before| + bound
    slack = BOUND_RTOL * bound + B_ULPS * (float(before.abs().max()) + bound)
    if not moved <= bound + slack:  # NaN and an overflow to infinity fail too
        raise OutOfBounds(f"step {step}: B moved by {moved:.6g}, more than {optimizer}'s bound {bound:.6g}")
