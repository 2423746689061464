"""Differentially private zeroth-order steps (DP-ZO, arXiv 2401.04343): what of a step leaves the device is its q
projected gradients g_i, so privatizing those scalars privatizes the whole upload.

A private step (``shared.zo.zo_step`` with a ``Privatizer``):

1. each example's own projected difference d = (loss(B + eps z_i) - loss(B - eps z_i)) / (2 eps) is clipped to
   [-C, C] (the example belongs to query i, one of q queries of E = batch / q examples each);
2. g_i = mean of its E clipped differences + Gaussian noise of standard deviation sigma * 2C / E, drawn from a
   generator whose seed stays on the device (the server cannot subtract it): NumPy's (PCG64, ``standard_normal``
   in float32), the one generator of every backend and of eager training, so a device without torch draws the
   same noise as a run in PyTorch. The noise never leaves the device: the server knows its distribution
   (``g_bound``), never its values;
3. B is updated with the noised g, the log records the noised g alone: no losses, no per-example value.

The batches are drawn uniformly without replacement, ``batch`` of the device's ``examples`` at each step, from a
private generator too (``private_batch``). Replacing one example changes one g_i by at most 2C / E, so each step is
a Gaussian mechanism with noise multiplier sigma under the replace-one relation, amplified by the sampling; the
accountant is ``dp-accounting``'s RDP accountant of ``steps`` such sampled Gaussian steps (Wang, Balle and
Kasiviswanathan's bound for sampling without replacement), nothing written here and nothing of it here: it lives in
``shared.accounting`` (torch-free, so the server's processes use it without torch), whose ``noise_multiplier`` finds
sigma for a target (epsilon, delta) and ``epsilon_spent`` the epsilon of a run.

The server checks a private log without its losses (``g_bound``): every g within C plus the noise's tail, at a
stated false-rejection rate for the whole log.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

# The accountant's, here for the trainers and benchmarks (its home is torch-free: the server's processes use it).
from shared.accounting import epsilon_spent as epsilon_spent
from shared.accounting import ledger_epsilon as ledger_epsilon
from shared.accounting import noise_multiplier as noise_multiplier

FALSE_REJECTION = 1e-9  # the chance that an honest private log fails g_bound (over all of its values)


def noise_std(sigma: float, clip: float, examples_per_query: int) -> float:
    """The standard deviation of each g_i's noise: sigma times g_i's replace-one sensitivity, 2C / E."""
    return sigma * 2.0 * clip / examples_per_query


def g_bound(
    clip: float, sigma: float, examples_per_query: int, values: int, false_rejection: float = FALSE_REJECTION
) -> float:
    """The largest |g| an honest private log holds with probability 1 - ``false_rejection`` over its ``values``
    values (a union bound): C plus the Gaussian tail of the noise at ``false_rejection / values`` per value."""
    from scipy.stats import norm

    per_value = false_rejection / max(values, 1)
    return clip + float(norm.isf(per_value / 2)) * noise_std(sigma, clip, examples_per_query)


def stream_seed(private_seed: int, stream: int, step: int) -> int:
    """A 63-bit seed of one stream (0: batches, 1: noise) at one step, from the run's private seed."""
    return int(np.random.SeedSequence([private_seed, stream, step]).generate_state(1, np.uint64)[0] >> 1)


def private_batch(examples: int, batch_size: int, rng: np.random.Generator) -> list[int]:
    """``batch_size`` distinct example indices drawn uniformly from ``examples`` (a private step's sample)."""
    return [int(i) for i in rng.choice(examples, size=batch_size, replace=False)]


def step_sample(private_seed: int, step: int, examples: int, batch_size: int) -> list[int]:
    """Step ``step``'s sample of a private run (stream 0): the same whatever ran before, so a resumed run and
    every backend draw the same."""
    return private_batch(examples, batch_size, np.random.default_rng(stream_seed(private_seed, 0, step)))


def step_privatizer(private_seed: int, step: int, clip: float, std: float) -> Privatizer:
    """The privatizer whose next ``noise`` is step ``step``'s (stream 1), whatever ran before."""
    return Privatizer.seeded(clip, std, stream_seed(private_seed, 1, step))


@dataclass
class Privatizer:
    """The device's side of a private step: the clip C, the noise's standard deviation, and the private generator
    of the noise (seeded on the device, never uploaded; NumPy's, whatever runs the step); the step takes C and
    ``noise(q)`` as tensors or arrays (``shared.zo.zo_step``, a program's inputs)."""

    clip: float
    std: float
    generator: np.random.Generator

    @classmethod
    def seeded(cls, clip: float, std: float, seed: int) -> Privatizer:
        return cls(clip, std, np.random.default_rng(seed))

    def noise(self, q: int) -> np.ndarray:
        """The next step's noise of its q g's: float32 standard normals times the run's standard deviation (as a
        float32), in float32."""
        return self.generator.standard_normal(q, dtype=np.float32) * np.float32(self.std)


def private_g(differences: torch.Tensor, clip: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """[q] private projected gradients: each example's difference [q, E] clipped to [-clip, clip], their mean per
    query, plus ``noise`` [q]. Tensor arithmetic only (this module imports no torch), so that a program computes it
    as eager training does."""
    return differences.clamp(-clip, clip).mean(dim=1) + noise
