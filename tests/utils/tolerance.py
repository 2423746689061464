"""Float tolerances derived from the quantities being compared, so that a comparison holds on any CPU.

Two runs of the same mathematics that differ in kernels (ATen's default, AVX2 or AVX-512 code; XNNPACK in a
``.pte``) or in padding width differ only in the order and blocking of their floating-point sums. A sum of n
terms computed in any order lies within gamma_n = n*u of the exact sum, relative to the sum of the terms'
magnitudes (Higham, *Accuracy and Stability of Numerical Algorithms*, section 4.2), where u is the unit roundoff
(2**-24 for float32, 2**-53 for float64). A forward pass chains such sums through its layers, so a loss is bounded,
relative to its size, by that gamma once for each layer it passes, for the model's longest reduction:

    loss_rtol = (layers + 2) * n_max * u      n_max = max(hidden, intermediate, vocabulary)

(+2: the embedding side with attention over positions, and the output head with its log-sum-exp over the
vocabulary). It is a worst-case bound: the differences seen in practice are a few u, so it does not fail by chance
on another CPU, while a mistake in the mathematics (a path on the wrong rows, a wrong sign or seed) moves a loss by
about eps*|g|, orders of magnitude more. From it, for one ZO step from the same B:

    g_atol = 2 * loss_atol / (2 * eps)          g = (L+ - L-) / (2 eps), each loss off by up to loss_atol
    b_atol = lr * g_atol * Z_MAX                B - (lr/q) sum_i g_i z_i: q terms, each |z| <= Z_MAX, over q

Over several steps an error in B also feeds the next steps' losses, which this bound does not cover: multi-step
identities are therefore checked in float64 (rounding 2**29 times smaller), where the feedback stays many orders
below any tolerance that a defect could hide under; float32 runs are compared one step at a time.
"""

from __future__ import annotations

import torch

from shared.noise import SCALE

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float64: 2.0**-53}
# |z| <= the largest centred Irwin-Hall sum (4 * (2**16 - 1) / 2) times the noise's scale: about 3.46.
Z_MAX = 2 * (2**16 - 1) * SCALE


def loss_rtol(config, dtype: torch.dtype = torch.float32) -> float:
    """Relative bound on the difference of two evaluations of one loss of a model with this HF ``config``."""
    n_max = max(config.hidden_size, config.intermediate_size, config.vocab_size)
    return (config.num_hidden_layers + 2) * n_max * UNIT_ROUNDOFF[dtype]


def step_atols(config, dtype: torch.dtype, loss_scale: float, eps: float, lr: float) -> tuple[float, float, float]:
    """(loss, g, B) absolute bounds for one ZO step taken from the same B, losses of size ``loss_scale``."""
    loss_atol = loss_rtol(config, dtype) * loss_scale
    g_atol = 2 * loss_atol / (2 * eps)
    return loss_atol, g_atol, lr * g_atol * Z_MAX


def b_drift(g_a, g_b, lr: float, dtype: torch.dtype = torch.float32) -> list[float]:
    """Bounds on ||B_a - B_b||_inf before each step of two free-running runs, from their measured g's.

    Both runs apply B <- B - (lr/q) sum_i g_i z_i with the same z, so after step k their B's differ by at most
    sum_{j<k} (lr/q) sum_i |g_a,ji - g_b,ji| * Z_MAX, plus one rounding of B per step (4 u |B|, with |B| <= the
    update sizes summed). ``g_a``, ``g_b``: per step, the q projected gradients of each run.
    """
    bounds, drift, size = [0.0], 0.0, 0.0
    for ga, gb in zip(g_a, g_b, strict=True):
        ga, gb = torch.as_tensor(ga, dtype=torch.float64), torch.as_tensor(gb, dtype=torch.float64)
        q = ga.numel()
        size += lr / q * float(ga.abs().sum()) * Z_MAX
        drift += lr / q * float((ga - gb).abs().sum()) * Z_MAX + 4 * UNIT_ROUNDOFF[dtype] * size
        bounds.append(drift)
    return bounds


def losses_atol_with_drift(loss_atol: float, g_all, drift_inf: float, size: int) -> float:
    """Loss bound at B's that differ by ``drift_inf`` (inf-norm) in ``size`` coordinates.

    |L(B_a) - L(B_b)| <= ||grad L||_2 ||B_a - B_b||_2 <= ||grad L||_2 sqrt(D) drift_inf. The projected gradients
    estimate the gradient's norm: g = grad L . z with E[z z^T] = I, so E[g^2] = ||grad L||^2; twice their
    root-mean-square over the run covers the estimate's spread.
    """
    g = torch.cat([torch.as_tensor(x, dtype=torch.float64).reshape(-1) for x in g_all])
    grad_norm = 2 * float(g.square().mean().sqrt())
    return loss_atol + grad_norm * size**0.5 * drift_inf
