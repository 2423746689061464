"""How a step's projected gradients move B: the ZO optimizers, each a fixed sequence of float32 operations, so that
eager training and the replay of a log (``shared.replay``) rebuild the same B and optimizer state bit for bit.

With u = (1/q) Σ g_i z_i (summed left to right, as ``shared.zo.updated_b``), step k at learning rate lr:

- ``sgd`` (the default; today's update): B ← B − lr·u. No state.
- ``momentum``: m ← β·m + (1 − β)·u, B ← B − lr·m (β = 0.9; an exponential average, so an lr tuned for ``sgd``
  moves B about as far per step). State: m, D floats.
- ``normalized``: v ← β₂·v + (1 − β₂)·mean(g²), B ← B − lr_k·u / (√v + δ) (β₂ = 0.99, δ = 1e-8): the step is
  measured in units of the run's recent |g| (the spread of the step's loss differences), as FZOO sets its step from
  the spread of its losses. State: v, one float. Adam's bias correction √(1 − β₂^(k+1)) is a scalar of k alone, so
  it is folded into the step's lr on the host (``lr_factor``), which the log records as the lr used.

The state is a function of the logged g alone, so the server rebuilds it from the log: nothing but B is uploaded.
Bounds on what a log can do to B, per coordinate and step: ``sgd`` and ``momentum`` move it by at most
lr·max|g|·max|z| (momentum averages past steps' u, each bounded the same way), so the verifier's bound on |g|
bounds them; ``normalized`` by at most lr·10·√q·max|z| whatever the g, because v ≥ (1 − β₂)·mean(g²) gives
|g_i|/√v ≤ √(q/(1 − β₂)) = 10·√q.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from shared.backends import OPTIMIZERS
from shared.zo import updated_b, weighted_sum

BETA, BETA2, DELTA = 0.9, 0.99, 1e-8


def new_state(optimizer: str, d: int, dtype: torch.dtype = torch.float32, device=None) -> dict[str, torch.Tensor]:
    """The state before the first step: zeros."""
    if optimizer == "momentum":
        return {"m": torch.zeros(d, dtype=dtype, device=device)}
    if optimizer == "normalized":
        return {"v": torch.zeros(1, dtype=dtype, device=device)}
    if optimizer != "sgd":
        raise ValueError(f"unknown optimizer {optimizer!r} (choose from {', '.join(OPTIMIZERS)})")
    return {}


def lr_factor(optimizer: str, step: int) -> float:
    """What the host multiplies step ``step``'s scheduled lr by (``normalized``: the bias correction of v)."""
    return math.sqrt(1.0 - BETA2 ** (step + 1)) if optimizer == "normalized" else 1.0


def step_lr(optimizer: str, lr: float, step: int) -> float:
    """Step ``step``'s lr as the update takes it and the log records it: the schedule's float32 ``lr`` times
    ``lr_factor``, rounded to float32 (``sgd``: ``lr`` itself)."""
    factor = lr_factor(optimizer, step)
    return lr if factor == 1.0 else float(np.float32(lr * factor))


def update(
    optimizer: str, b: torch.Tensor, z: torch.Tensor, g: torch.Tensor, lr: torch.Tensor, state: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(new B, new state) after one step; ``lr`` [1] is the step's (``lr_factor`` applied)."""
    if optimizer == "sgd":  # today's exact arithmetic, which every existing log replays with
        return updated_b(b, z, g, lr), state
    u = weighted_sum(z, g) / z.shape[0]
    if optimizer == "momentum":
        m = state["m"] * BETA + u * (1.0 - BETA)
        return b - m * lr, {"m": m}
    squares = weighted_sum(g[:, None], g)  # Σ g_i², left to right
    v = state["v"] * BETA2 + (squares / g.shape[0]) * (1.0 - BETA2)
    return b - u * (lr / (torch.sqrt(v) + DELTA)), {"v": v}
