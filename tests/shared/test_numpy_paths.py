"""What a device computes without torch, against the torch path, bit for bit: the replay and every optimizer's update
(``shared.replay``, ``shared.zo_optim``) on NumPy float32 arrays against the same update on torch tensors (the eager
step's and the program's arithmetic) with torch's noise; the step noise's NumPy twin; the batches' arrays; a private
step's noise, one NumPy draw for every backend and for eager training."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from shared.backends import OPTIMIZERS
from shared.data import Encoded, training_arrays, training_batch
from shared.noise import step_noise_np, step_seed
from shared.privacy import noise_std, step_privatizer, stream_seed
from shared.replay import replay, replay_state
from shared.schedule import lr_at
from shared.zo import step_noise
from shared.zo_optim import new_state, step_lr, update

pytestmark = pytest.mark.numerics


def bits(values) -> np.ndarray:
    """The float32 bits of an array or a tensor, to compare with ``np.array_equal``."""
    array = values.numpy() if isinstance(values, torch.Tensor) else values
    assert array.dtype == np.float32
    return array.view(np.uint32)


def random_log(optimizer: str, steps: int, q: int, seed: int) -> list[dict]:
    """A log of ``steps`` steps at a warm-up and cosine schedule (``optimizer``'s lr as logged), each step's g of
    another magnitude (1e-3 to 1e3: normalized's v moves by orders, momentum's m mixes scales)."""
    rng = np.random.default_rng(seed)
    log = []
    for k in range(steps):
        lr = step_lr(optimizer, lr_at(0.05, steps, k, "cosine", warmup_steps=3, lr_floor=0.1), k)
        g = (rng.normal(size=q) * 10.0 ** rng.uniform(-3, 3)).astype(np.float32)
        log.append({"step": k, "seed": step_seed(seed, k), "lr": lr, "eps": 0.01, "g": g.tolist()})
    return log


def torch_steps(init_b: np.ndarray, log: list[dict], optimizer: str) -> tuple[torch.Tensor, dict]:
    """The log's steps as the eager step and the program take them: torch's noise, the update on tensors."""
    b, state = torch.from_numpy(init_b.copy()), new_state(optimizer, init_b.size)
    for record in log:
        g = torch.tensor(record["g"], dtype=torch.float32)
        z = step_noise(torch.tensor([record["seed"]]), g.shape[0], b.shape[0])
        b, state = update(optimizer, b, z, g, torch.tensor([record["lr"]], dtype=torch.float32), state)
    return b, state


@pytest.mark.parametrize("q", [3, 4])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_the_numpy_replay_is_the_torch_steps_bit_for_bit(optimizer: str, q: int) -> None:
    d = 4099  # odd: no vector width divides it
    log = random_log(optimizer, 30, q, seed=11 + q)
    init = np.random.default_rng(q).normal(0, 0.1, d).astype(np.float32)
    want_b, want_state = torch_steps(init, log, optimizer)
    b, state = replay_state(init, log, optimizer, check=True)  # the server's check passes on the same steps
    assert isinstance(b, np.ndarray) and np.array_equal(bits(b), bits(want_b))
    assert set(state) == set(want_state)
    assert all(np.array_equal(bits(state[k]), bits(want_state[k])) for k in state)
    assert not np.array_equal(b, init) and all(np.abs(v).max() > 0 for v in state.values())
    # In pieces (a device's resume, its held-out points), the state carried: the same bits.
    half, kept = replay_state(init, log[:13], optimizer)
    assert np.array_equal(bits(replay_state(half, log[13:], optimizer, kept)[0]), bits(b))
    # A torch caller (the server's verification, the tests) gets tensors of the same bits.
    from_torch = replay(torch.from_numpy(init.copy()), log, optimizer)
    assert isinstance(from_torch, torch.Tensor) and np.array_equal(bits(from_torch), bits(b))


def test_the_step_noise_twin_is_torchs_noise() -> None:
    for seed, q, d in [(0, 1, 1), (77, 3, 1001), (2**31 - 1, 2, 65537)]:
        assert np.array_equal(bits(step_noise_np(seed, q, d)), bits(step_noise(torch.tensor([seed]), q, d)))


def test_the_batch_arrays_are_the_tensors_of_the_batch() -> None:
    examples = [Encoded([5, 6, 7, 8, 9], [[10], [11, 12]], 1), Encoded([5], [[13, 14, 15], [16]], 0)]
    for widths in [(None, None), (9, 4)]:
        arrays = training_arrays(examples, 3, *widths)
        batch = training_batch(examples, 3, *widths)
        assert all(a.dtype == np.int64 for a in arrays)
        for array, tensor in zip(arrays, (batch.input_ids, batch.attention_mask, batch.targets), strict=True):
            assert tensor.dtype == torch.long and np.array_equal(array, tensor.numpy())


def test_a_private_steps_noise_is_one_numpy_draw_for_every_backend_and_eager_training() -> None:
    """The device's noise (``device_agent.job.private_noise``, what the executorch, torch and runner backends take)
    is eager training's (``shared.train.MethodStep``'s g_noise), both NumPy's generator on the private seed's
    stream 1 at the step."""
    from device_agent.job import private_noise
    from shared.train import MethodStep

    spec = SimpleNamespace(privacy=SimpleNamespace(clip=0.5, noise_multiplier=1.3), batch_size=12, q=3)
    seed, std = 2**61 + 5, noise_std(1.3, 0.5, 4)
    device = private_noise(spec, seed)
    eager = MethodStep("mezo", torch.nn.Linear(1, 1), None, q=3)  # its private inputs alone need no LoRA model
    draws = []
    for k in (0, 1, 7):
        clip, noise = device(k)
        eager.privatizer = step_privatizer(seed, k, 0.5, std)
        inputs = eager._private()
        assert clip == float(np.float32(0.5)) == float(inputs["clip"])
        want = np.random.default_rng(stream_seed(seed, 1, k)).standard_normal(3, dtype=np.float32) * np.float32(std)
        assert np.array_equal(bits(noise), bits(want)) and np.array_equal(bits(inputs["g_noise"]), bits(want))
        draws.append(noise)
    assert len({d.tobytes() for d in draws}) == 3  # each step draws its own
