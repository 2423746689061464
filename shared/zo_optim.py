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
In a device program the state is one flat mutable buffer beside B (``state_size`` floats: D for momentum, 1 for
normalized, none for sgd); setting B starts it from zeros, and a resumed run sets it after B (``flat_state``).

Bounds on what a log can do to B, per coordinate and step (``step_bound``; the verifier checks every replayed step
against it), with Z = max|z| (``shared.noise.MAX_Z``, 3.46) and mean|g| over the step's q values:

- ``sgd``: lr·Z·mean|g|, since |u_j| ≤ (1/q)·Σ|g_i|·|z_ij|;
- ``momentum``: lr·Z·max over the steps so far of mean|g| (m is an average of past u with weights summing to
  1 − β^(k+1) ≤ 1, each u bounded as above; a resumed state adds its own max|m|);
- ``normalized``: lr·Z·10 whatever the g: mean|g| ≤ √mean(g²) and v ≥ (1 − β₂)·mean(g²), so |u_j|/√v ≤
  Z/√(1 − β₂).

So ``sgd`` and ``momentum`` are bounded by the verifier's bound on |g| (each g what its losses give, losses in
[0, MAX_LOSS]), and ``normalized`` by its learning rate alone.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from shared.backends import OPTIMIZERS
from shared.noise import MAX_Z
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


def state_size(optimizer: str, d: int) -> int:
    """Floats of the optimizer's state for a B of ``d``: what a program's ``set_opt_state`` takes."""
    return sum(t.numel() for t in new_state(optimizer, d, device="meta").values())


def flat_state(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """The state as one flat tensor (every optimizer here keeps at most one tensor)."""
    return next(iter(state.values())).reshape(-1) if state else torch.zeros(0)


def state_of(optimizer: str, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """The state dict of ``flat_state``'s tensor."""
    names = {"momentum": "m", "normalized": "v"}
    return {names[optimizer]: flat} if optimizer in names else {}


def step_bound(optimizer: str, lr: float, g, carried: float = 0.0) -> tuple[float, float]:
    """(the most any coordinate of B may move at this step, what the next step's bound carries) for a step at the
    logged ``lr`` with projected gradients ``g`` (the module's bounds; exact arithmetic, float64). ``carried``:
    momentum's running max of Z·mean|g| (or max|m| of a resumed state); 0 for the first step."""
    mean_abs = float(np.mean(np.abs(np.asarray(g, dtype=np.float64))))
    if optimizer == "normalized":
        return lr * MAX_Z / math.sqrt(1.0 - BETA2), 0.0
    u = MAX_Z * mean_abs
    if optimizer == "momentum":
        carried = max(carried, u)
        return lr * carried, carried
    return lr * u, 0.0


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
    # √v in float64, rounded once to float32: the correctly rounded float32 square root everywhere. XNNPACK's float32
    # sqrt, and ATen's vectorized one, are not (1,347 of 4,096 and 17 % of values an ulp off on an x86-64 VM), and
    # float64 keeps the op in ExecuTorch's portable kernels.
    root = torch.sqrt(v.to(torch.float64)).to(torch.float32)
    return b - u * (lr / (root + DELTA)), {"v": v}
