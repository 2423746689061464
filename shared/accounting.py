"""The privacy accountant of private runs (``shared.privacy``), torch-free: dp-accounting's RDP accountant of
``steps`` sampled Gaussian steps (Wang, Balle and Kasiviswanathan's bound for sampling without replacement), under
the replace-one relation. ``noise_multiplier`` finds sigma for a target (epsilon, delta), ``epsilon_spent`` the
epsilon of one run, ``ledger_epsilon`` the epsilon of several composed (a user's privacy ledger).

Both costly steps are remembered per process, by their inputs: a calibration (seconds: dp-accounting's search over
sigma) and a run's RDP curve (``run_rdp``, about a tenth of a second: the accountant's sum over its orders). A ledger
is then the sum of its runs' curves, converted once (``compute_epsilon``), which is exactly what the accountant
itself computes when it composes the runs in order. ``known_noise_multiplier`` and ``known_rdp`` look a value up
without computing it, and ``remember_*`` store one computed elsewhere: the server computes both in a worker process
(``server.privacy.Accountant``) and keeps the results in its own process.
"""

from __future__ import annotations

import math

from shared.lru import LRUCache

Run = tuple[float, int, int, int]  # (noise multiplier, steps, batch size, examples)
Calibration = tuple[float, float, int, int, int]  # (epsilon, delta, steps, batch size, examples)


_SIGMAS: LRUCache[Calibration, float] = LRUCache(4096)
_RDPS: LRUCache[Run, tuple[float, ...]] = LRUCache(65536)  # about 1.3 kB each


def _event(noise_multiplier: float, steps: int, batch_size: int, examples: int):
    from dp_accounting import GaussianDpEvent, SampledWithoutReplacementDpEvent, SelfComposedDpEvent

    step = SampledWithoutReplacementDpEvent(examples, batch_size, GaussianDpEvent(noise_multiplier))
    return SelfComposedDpEvent(step, steps)


def _accountant():
    from dp_accounting import NeighboringRelation
    from dp_accounting.rdp import RdpAccountant

    return RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)


def check_sampling(batch_size: int, examples: int) -> None:
    if not 1 <= batch_size <= examples:
        raise ValueError(f"a private batch draws {batch_size} of {examples} examples: need 1 <= batch <= examples")


def epsilon_spent(noise_multiplier: float, delta: float, steps: int, batch_size: int, examples: int) -> float:
    """The epsilon at ``delta`` of ``steps`` private steps with this noise multiplier, each on ``batch_size`` of
    ``examples`` examples drawn without replacement."""
    check_sampling(batch_size, examples)
    accountant = _accountant()
    accountant.compose(_event(noise_multiplier, steps, batch_size, examples))
    return float(accountant.get_epsilon(delta))


def _calibrate(epsilon: float, delta: float, steps: int, batch_size: int, examples: int) -> float:
    from dp_accounting import mechanism_calibration

    check_sampling(batch_size, examples)
    if not (epsilon > 0 and 0 < delta < 1 and steps >= 1):
        raise ValueError(f"need epsilon > 0, 0 < delta < 1, steps >= 1 (got {epsilon}, {delta}, {steps})")
    sigma = mechanism_calibration.calibrate_dp_mechanism(
        _accountant,
        lambda s: _event(s, steps, batch_size, examples),
        epsilon,
        delta,
        mechanism_calibration.LowerEndpointAndGuess(0.05, 1.0),  # sigma 0 divides by zero
        tol=1e-5,
    )
    return math.ceil(float(sigma) * 1e4) / 1e4  # rounded up: never below what the target needs


def noise_multiplier(epsilon: float, delta: float, steps: int, batch_size: int, examples: int) -> float:
    """The smallest noise multiplier sigma (within 1e-4) whose ``steps`` steps spend at most ``epsilon`` at
    ``delta`` (``dp-accounting``'s calibration, a few seconds: remembered per process)."""
    key = (float(epsilon), float(delta), int(steps), int(batch_size), int(examples))
    sigma = _SIGMAS.get(key)
    if sigma is None:
        sigma = _calibrate(*key)
        _SIGMAS.put(key, sigma)
    return sigma


def known_noise_multiplier(key: Calibration) -> float | None:
    """The noise multiplier of ``key`` (epsilon, delta, steps, batch size, examples) if this process has it."""
    return _SIGMAS.get(tuple(key))


def remember_noise_multiplier(key: Calibration, sigma: float) -> None:
    _SIGMAS.put(tuple(key), float(sigma))


def run_rdp(run: Run) -> tuple[float, ...]:
    """The RDP curve of one run (noise multiplier, steps, batch size, examples) at the accountant's orders, as the
    accountant adds it when it composes the run (remembered per process)."""
    run = (float(run[0]), int(run[1]), int(run[2]), int(run[3]))
    curve = _RDPS.get(run)
    if curve is None:
        check_sampling(run[2], run[3])
        accountant = _accountant()
        accountant.compose(_event(*run))
        curve = tuple(float(x) for x in accountant.rdp)
        _RDPS.put(run, curve)
    return curve


def run_rdps(runs: list[Run]) -> list[tuple[float, ...]]:
    """``run_rdp`` of each run (for a worker process: one round trip for several)."""
    return [run_rdp(run) for run in runs]


def known_rdp(run: Run) -> tuple[float, ...] | None:
    return _RDPS.get((float(run[0]), int(run[1]), int(run[2]), int(run[3])))


def remember_rdp(run: Run, curve: tuple[float, ...]) -> None:
    _RDPS.put((float(run[0]), int(run[1]), int(run[2]), int(run[3])), tuple(curve))


def ledger_epsilon(runs: list[Run], delta: float) -> float:
    """The epsilon at ``delta`` of several private runs together, each (noise multiplier, steps, batch size,
    examples): one accountant composes them all (a user's privacy ledger), its curves added in the order given as
    the accountant adds them. 0 for none."""
    if not runs:
        return 0.0
    import numpy as np
    from dp_accounting.rdp.rdp_privacy_accountant import DEFAULT_RDP_ORDERS, compute_epsilon

    total = np.zeros(len(DEFAULT_RDP_ORDERS), dtype=np.float64)
    for run in runs:
        total += np.asarray(run_rdp(run), dtype=np.float64)
    return float(compute_epsilon(DEFAULT_RDP_ORDERS, total, delta)[0])
