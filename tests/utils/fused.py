"""The sgd update as a build that fuses multiply-adds would compute it: what the device side must never do.

``shared.zo.updated_b`` is ``b - (Σ g_i z_i) * (lr / q)``, each multiply and each add rounded to float32 on its own,
which is what the program's kernels and the server's replay compute. A compiler that contracts ``a * b + c`` into a
fused multiply-add (GCC's default for C and C++ on aarch64 without ``-ffp-contract=off``) rounds each pair once.
Here a fused multiply-add is computed in float64 (the product of two float32 values is exact there) and rounded to
float32 once; that differs from a true fused multiply-add only on a float64 tie, about once in 2^29 roundings.
"""

from __future__ import annotations

import numpy as np
import torch

from shared.zo import step_noise


def fma32(a: np.ndarray, b: np.ndarray | np.float32, c: np.ndarray) -> np.ndarray:
    """a * b + c rounded to float32 once."""
    return (a.astype(np.float64) * np.float64(b) + c.astype(np.float64)).astype(np.float32)


def mul_add32(a: np.ndarray, b: np.ndarray | np.float32, c: np.ndarray) -> np.ndarray:
    """a * b + c rounded to float32 twice, as the program and the replay compute it."""
    return (a * np.float32(b)).astype(np.float32) + c


def fused_replay(init: np.ndarray, log: list[dict], fused: bool = True) -> np.ndarray:
    """B after every step of an sgd log, each step's multiply-adds fused (``fused=False``: rounded twice each, the
    control that gives the replay's bits)."""
    madd = fma32 if fused else mul_add32
    b = init.astype(np.float32).copy()
    for record in log:
        g = np.asarray(record["g"], dtype=np.float32)
        z = step_noise(torch.tensor([int(record["seed"])]), len(g), b.size).numpy()
        acc = z[0] * g[0]
        for i in range(1, len(g)):
            acc = madd(z[i], g[i], acc)  # acc + z_i * g_i, one rounding
        scale = np.float32(record["lr"]) / np.float32(len(g))
        b = madd(-acc, scale, b)  # b - acc * scale, one rounding
    return b
