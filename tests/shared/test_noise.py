"""The noise generator: torch and NumPy agree bit for bit; the values look like N(0, 1) draws."""

import numpy as np
import pytest
import torch

from shared.noise import MASK32, noise, noise_np, noise_range, step_seed

pytestmark = pytest.mark.numerics  # CI runs these again on ATen's portable kernels (.ci/run)

N = 1_200_000


@pytest.mark.parametrize("seed", [0, 1, 2**31 - 1, 123456789])
def test_torch_and_numpy_are_bit_identical(seed):
    z_torch = noise_range(torch.tensor([seed]), N).numpy()
    z_np = noise_np(seed, np.arange(N))
    assert z_torch.dtype == np.float32 and z_np.dtype == np.float32
    assert np.array_equal(z_torch.view(np.int32), z_np.view(np.int32))


def test_arbitrary_indices_near_the_top_of_the_range():
    index = torch.tensor([0, 1, 2**32 - 2, 2**32 - 1, 2**31, 977])
    z = noise(torch.tensor([5]), index).numpy()
    assert np.array_equal(z.view(np.int32), noise_np(5, index.numpy()).view(np.int32))


def test_mean_and_variance():
    z = noise_np(42, np.arange(N)).astype(np.float64)
    assert abs(z.mean()) < 5 / np.sqrt(N)
    assert abs(z.var() - 1.0) < 0.01
    # Irwin-Hall(4): bounded, symmetric, and with the normal's light tails (kurtosis 2.4 vs 3).
    assert np.abs(z).max() < 3.47
    assert abs(((z - z.mean()) ** 3).mean()) < 0.01


def _corr_z(a: np.ndarray, b: np.ndarray) -> float:
    """Correlation scaled by sqrt(n): about N(0, 1) for independent draws."""
    return float(np.corrcoef(a, b)[0, 1] * np.sqrt(len(a)))


def test_no_correlation_across_neighbouring_seeds_and_indices():
    idx = np.arange(200_000)
    seeds = [_corr_z(noise_np(s, idx), noise_np(s + 1, idx)) for s in range(20)]
    assert max(abs(c) for c in seeds) < 4.5
    assert abs(np.mean(seeds)) < 1.5  # 20 z-scores: their mean has std 0.22
    z = noise_np(7, np.arange(N))
    for lag in (1, 2, 3, 16, 1024):
        assert abs(_corr_z(z[:-lag], z[lag:])) < 4.5


def test_no_int64_overflow_in_the_mixer():
    # Values stay in [0, 2**32) and multipliers are < 2**31, so every product is < 2**63.
    from shared import noise as nz

    assert nz._MUL1 < 2**31 and nz._MUL2 < 2**31 and MASK32 < 2**32
    x = torch.tensor([MASK32, 0, 2**31], dtype=torch.int64)
    out = nz.mix32(x)
    assert bool(((out >= 0) & (out <= MASK32)).all())


def test_step_seed_is_a_pure_function_in_range():
    seeds = [step_seed(3, k) for k in range(1000)]
    assert seeds == [step_seed(3, k) for k in range(1000)]
    assert len(set(seeds)) == 1000 and all(0 <= s < 2**31 for s in seeds)
    assert step_seed(3, 0) != step_seed(4, 0)
    with pytest.raises(ValueError):
        step_seed(-1, 0)


class _StepNoise(torch.nn.Module):
    """A step's noise as the device program generates it, exported alone."""

    def __init__(self, q: int, size: int) -> None:
        super().__init__()
        self.q, self.size = q, size

    def forward(self, seed: torch.Tensor) -> torch.Tensor:
        from shared.zo import step_noise

        return step_noise(seed, self.q, self.size)


def _flat(seed: int, q: int, size: int) -> np.ndarray:
    return noise_np(seed, np.arange(q * size)).reshape(q, size)


@pytest.mark.parametrize("q", [1, 3, 16])
def test_noise_per_query_equals_the_flat_noise_bit_for_bit(q):
    from shared.zo import step_noise

    size = 1_003  # not a power of two: query boundaries fall anywhere
    z = step_noise(torch.tensor([77]), q, size).numpy()
    assert z.shape == (q, size)
    assert np.array_equal(z.view(np.int32), _flat(77, q, size).view(np.int32))
    start = noise_range(torch.tensor([77]), 10, start=size).numpy()
    assert np.array_equal(start.view(np.int32), _flat(77, 2, size)[1, :10].view(np.int32))


def test_noise_per_query_in_a_pte_equals_the_flat_noise_bit_for_bit():
    from executorch.exir import to_edge
    from executorch.runtime import Runtime

    q, size = 4, 1_003
    exported = torch.export.export(_StepNoise(q, size), (torch.tensor([1]),), strict=False)
    program = Runtime.get().load_program(to_edge(exported).to_executorch().buffer)
    method = program.load_method("forward")
    for seed in (0, 12345, 2**31 - 1):
        z = method.execute([torch.tensor([seed])])[0].numpy()
        assert np.array_equal(z.view(np.int32), _flat(seed, q, size).view(np.int32))


def test_noise_range_refuses_indices_outside_32_bits():
    with pytest.raises(ValueError):
        noise_range(torch.tensor([1]), 2, start=2**32 - 1)
    with pytest.raises(ValueError):
        noise_range(torch.tensor([1]), 1, start=-1)
