"""The one noise generator of mobizo: ``noise(seed, index) -> float32``, counter-based and stateless.

Why this construction: the device program regenerates the perturbation z in-graph, the server replays training
from a log, and both must get the *same bits* as eager PyTorch. Transcendental kernels (log, cos, sqrt) differ by
an ulp between ATen and ExecuTorch, so a Box-Muller normal would not replay. Here every step is an integer op or a
single float multiply, each of which is exactly rounded on every implementation:

1. keys ``k1, k2`` come from the seed through a 32-bit integer mixer (``mix32``);
2. ``a = mix32(index ^ k1)`` and ``b = mix32(a ^ k2)`` give 64 well-mixed bits per index;
3. their four 16-bit halves are summed (Irwin-Hall with n = 4: already close to a normal, bounded by ±3.46);
4. the centred integer sum becomes float32 exactly (|sum| < 2**18) and one float32 multiply gives variance 1.

All integers live in int64 but stay below 2**63: values are kept under 2**32 and multiplied only by constants
under 2**31, so there is no signed overflow (undefined behaviour in the C++ kernels). Right shifts are written as
floor division (ExecuTorch has no ``>>`` kernel). Indices must be in [0, 2**32) and seeds in [0, 2**31).

The module imports torch only inside the torch twin's functions: a device without torch draws the same z with the
NumPy twin (``noise_np``, ``step_noise_np``), and the step seeds are NumPy's (``step_seed``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

MASK32 = 0xFFFFFFFF
_MUL1 = 0x7FEB352D  # odd multipliers below 2**31 (the first is lowbias32's)
_MUL2 = 0x5BD1E995
_SEED_SALT = 0x2545F491
_HALF = 1 << 16
# Sum of four uniform integers in [0, 2**16): mean 4 * (2**16 - 1) / 2, variance 4 * (2**32 - 1) / 12.
_CENTRE = 2 * (_HALF - 1)
SCALE = float(np.float32(1.0 / np.sqrt(4.0 * (float(_HALF) ** 2 - 1.0) / 12.0)))
MAX_INDEX = 1 << 32
# The largest |z|: the centred sum is at most _CENTRE away from 0 (bounds on an update, ``shared.zo_optim``).
MAX_Z = float(np.float32(_CENTRE) * np.float32(SCALE))
MAX_SEED = 1 << 31


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    import torch

    return torch.div(x, 1 << k, rounding_mode="floor")


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit mixer on int64 tensors holding values in [0, 2**32)."""
    import torch

    x = torch.bitwise_xor(x, _shr(x, 16))
    x = torch.bitwise_and(x * _MUL1, MASK32)
    x = torch.bitwise_xor(x, _shr(x, 15))
    x = torch.bitwise_and(x * _MUL2, MASK32)
    return torch.bitwise_xor(x, _shr(x, 16))


def _keys(seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    base = mix32(torch.bitwise_xor(seed * 2, _SEED_SALT))
    return mix32(base), mix32(torch.bitwise_xor(base, 1))


def noise(seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """z[i] for each entry of ``index`` (int64) under ``seed`` (int64 tensor, broadcastable); float32, mean 0, var 1."""
    import torch

    k1, k2 = _keys(seed)
    a = mix32(torch.bitwise_xor(index, k1))
    b = mix32(torch.bitwise_xor(a, k2))
    total = torch.bitwise_and(a, _HALF - 1) + _shr(a, 16) + torch.bitwise_and(b, _HALF - 1) + _shr(b, 16)
    return (total - _CENTRE).to(torch.float32) * SCALE


def noise_range(seed: torch.Tensor, count: int, start: int = 0) -> torch.Tensor:
    """z[start..start+count) under ``seed``: a contiguous slice of the one flat index space of a step.

    Callers take a step's noise slice by slice (one query's D values at a time, ``shared.zo.step_noise``) so that
    the int64 temporaries of the generator (several per value, twice the bytes of the float32 result) scale with
    the slice, not with all q*D indices; the values are the same bits as one call over the whole range.
    """
    import torch

    _check_range(start, count)
    return noise(seed, torch.arange(start, start + count, dtype=torch.int64, device=seed.device))


def _check_range(start: int, count: int) -> None:
    if start < 0 or start + count > MAX_INDEX:
        raise ValueError(f"noise range [{start}, {start + count}) is outside [0, 2**32)")


# --- NumPy twin (the replay of a log, on the server and on a device): the same operations in the same order --------


def _mix32_np(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> 16)
    x = (x * _MUL1) & MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & MASK32
    return x ^ (x >> 16)


def noise_np(seed: int, index: np.ndarray) -> np.ndarray:
    """NumPy twin of :func:`noise`; bit-identical float32 output."""
    seed_arr = np.int64(seed)
    base = _mix32_np(np.bitwise_xor(seed_arr * 2, np.int64(_SEED_SALT)))
    k1, k2 = _mix32_np(base), _mix32_np(base ^ np.int64(1))
    idx = np.asarray(index, dtype=np.int64)
    a = _mix32_np(idx ^ k1)
    b = _mix32_np(a ^ k2)
    total = (a & (_HALF - 1)) + (a >> 16) + (b & (_HALF - 1)) + (b >> 16)
    return (total - _CENTRE).astype(np.float32) * np.float32(SCALE)


def noise_range_np(seed: int, count: int, start: int = 0) -> np.ndarray:
    """NumPy twin of :func:`noise_range`: z[start..start+count) under ``seed``, the same bits."""
    _check_range(start, count)
    return noise_np(seed, np.arange(start, start + count, dtype=np.int64))


def step_noise_np(seed: int, q: int, size: int) -> np.ndarray:
    """NumPy twin of ``shared.zo.step_noise``: z [q, D] of one step, query i at indices i*D .. (i+1)*D, generated
    one query at a time (the int64 temporaries hold D values, not q*D)."""
    z = np.empty((q, size), np.float32)
    for i in range(q):
        z[i] = noise_range_np(seed, size, start=i * size)
    return z


def step_seed(run_seed: int, step: int) -> int:
    """The seed of training step ``step`` of a run: a pure function, so replay and resume need only the run seed."""
    if not 0 <= run_seed < MAX_SEED or step < 0:
        raise ValueError(f"run seed must be in [0, 2**31) and step >= 0 (got {run_seed}, {step})")
    mixed = _mix32_np(np.int64(run_seed) ^ _mix32_np((np.int64(step) ^ _SEED_SALT) & MASK32))
    return int(mixed) % MAX_SEED
