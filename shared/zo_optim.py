"""How a step's projected gradients move B: the ZO optimizers, each a fixed sequence of float32 operations, so that
eager training and the replay of a log (``shared.replay``) rebuild the same B and optimizer state bit for bit.

With u = (1/q) Σ g_i z_i (summed left to right, ``weighted_sum``), step k at learning rate lr:

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

One sequence of operations for every kind of array: ``weighted_sum``, ``updated_b`` and ``update`` take torch tensors
(the eager step, the exported program) or NumPy float32 arrays (the replay, ``shared.replay``, on the server and on a
device without torch) and run the same float32 operations in the same order, so the two give the same bits. A
Python float meets a float32 array as a float32, in NumPy 2 (NEP 50) and in NumPy 1.26's rules alike, as it meets
a float32 tensor in torch; the one operation that needs its own spelling, √v, is ``_root``. The module imports torch
only inside the functions that build torch state.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from shared.backends import OPTIMIZERS
from shared.noise import MAX_Z

if TYPE_CHECKING:
    import torch

BETA, BETA2, DELTA = 0.9, 0.99, 1e-8
_STATE_NAMES = {"momentum": "m", "normalized": "v"}


def state_sizes(optimizer: str, d: int) -> dict[str, int]:
    """The state's tensors and their lengths for a B of ``d``: momentum's m (D), normalized's v (1), none for sgd."""
    if optimizer == "momentum":
        return {"m": d}
    if optimizer == "normalized":
        return {"v": 1}
    if optimizer != "sgd":
        raise ValueError(f"unknown optimizer {optimizer!r} (choose from {', '.join(OPTIMIZERS)})")
    return {}


def new_state(optimizer: str, d: int, dtype: torch.dtype | None = None, device=None) -> dict[str, torch.Tensor]:
    """The state before the first step: zeros (torch tensors, float32 unless ``dtype`` says)."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    return {name: torch.zeros(n, dtype=dtype, device=device) for name, n in state_sizes(optimizer, d).items()}


def new_state_np(optimizer: str, d: int) -> dict[str, np.ndarray]:
    """``new_state`` as NumPy float32 arrays (the replay's)."""
    return {name: np.zeros(n, np.float32) for name, n in state_sizes(optimizer, d).items()}


def state_size(optimizer: str, d: int) -> int:
    """Floats of the optimizer's state for a B of ``d``: what a program's ``set_opt_state`` takes."""
    return sum(state_sizes(optimizer, d).values())


def flat_state(state: dict[str, Any]) -> Any:
    """The state as one flat tensor or array (every optimizer here keeps at most one); an empty torch tensor for
    none."""
    if state:
        return next(iter(state.values())).reshape(-1)
    import torch

    return torch.zeros(0)


def state_of(optimizer: str, flat: Any) -> dict[str, Any]:
    """The state dict of ``flat_state``'s tensor or array."""
    return {_STATE_NAMES[optimizer]: flat} if optimizer in _STATE_NAMES else {}


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


def weighted_sum(z, g):
    """Σ g_i z_i, summed left to right so every implementation rounds the same way (z [q, D], g [q]: tensors or
    arrays)."""
    acc = z[0] * g[0]
    for i in range(1, z.shape[0]):
        acc = acc + z[i] * g[i]
    return acc


def updated_b(b, z, g, lr):
    """B - (lr/q) Σ g_i z_i (the ``sgd`` update; ``lr`` [1])."""
    return b - weighted_sum(z, g) * (lr / z.shape[0])


def _root(v):
    """√v in float64, rounded once to float32: the correctly rounded float32 square root everywhere. XNNPACK's
    float32 sqrt, and ATen's vectorized one, are not (1,347 of 4,096 and 17 % of values an ulp off on an x86-64 VM),
    and float64 keeps the op in ExecuTorch's portable kernels."""
    if isinstance(v, np.ndarray):
        return np.sqrt(v.astype(np.float64)).astype(np.float32)
    import torch

    return torch.sqrt(v.to(torch.float64)).to(torch.float32)


def update(optimizer: str, b, z, g, lr, state: dict) -> tuple[Any, dict]:
    """(new B, new state) after one step; ``lr`` [1] is the step's (``lr_factor`` applied). Torch tensors or NumPy
    float32 arrays throughout (the module's one sequence of operations)."""
    if optimizer == "sgd":  # today's exact arithmetic, which every existing log replays with
        return updated_b(b, z, g, lr), state
    u = weighted_sum(z, g) / z.shape[0]
    if optimizer == "momentum":
        m = state["m"] * BETA + u * (1.0 - BETA)
        return b - m * lr, {"m": m}
    squares = weighted_sum(g[:, None], g)  # Σ g_i², left to right
    v = state["v"] * BETA2 + (squares / g.shape[0]) * (1.0 - BETA2)
    root = _root(v)
    return b - u * (lr / (root + DELTA)), {"v": v}
