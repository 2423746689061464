"""The ZO optimizers (``shared.zo_optim``): each run's log replays to its B bit for bit (the state rebuilt from the
logged g), a run in pieces (the state in the checkpoint) is the uninterrupted run, ``sgd`` is today's update, every
step stays within its optimizer's bound whatever a log says, and each optimizer's device program is its eager step
and its replay, bit for bit."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from shared.checkpoint import load_checkpoint
from shared.errors import UsageError
from shared.noise import MAX_Z
from shared.replay import OutOfBounds, replay, replay_state
from shared.schedule import lr_at
from shared.train import LOG_FILE, TrainConfig, program_config, train, with_defaults
from shared.train_log import log_record, read_log
from shared.zo import step_noise, updated_b
from shared.zo_optim import BETA2, flat_state, lr_factor, new_state, state_size, step_bound, step_lr, update
from tests.shared.test_train import TRAIN, adapter_flat_b

pytestmark = pytest.mark.numerics

RUN = {"task": "sst2", "train": TRAIN, "limit_train": 64, "device": "cpu", "method": "mobizo", "q": 2}
RUN |= {"batch_size": 4, "lr": 5e-2, "eps": 1e-2}


def _train(model: Path, out: Path, steps: int, **changes) -> dict:
    return train(TrainConfig(model=model, out=out, steps=steps, **RUN | changes), progress=False)


@pytest.mark.parametrize("optimizer", ["momentum", "normalized"])
def test_a_run_replays_to_its_b_and_resumes_to_the_same_bits(tiny_model_dir, tmp_path, optimizer):
    whole = _train(tiny_model_dir, tmp_path / "whole", 10, optimizer=optimizer)
    b = adapter_flat_b(tmp_path / "whole")
    log = read_log(tmp_path / "whole" / LOG_FILE)
    assert b.abs().max() > 0 and torch.equal(replay(torch.zeros_like(b), log, optimizer), b)
    assert not torch.equal(replay(torch.zeros_like(b), log, "sgd"), b)  # the optimizer is part of the meaning
    # the lr logged is the lr the update took: the schedule's, with normalized's bias correction
    expected = [step_lr(optimizer, lr_at(5e-2, 10, k, whole["lr_schedule"]), k) for k in range(10)]
    assert [r["lr"] for r in log] == expected
    pieces = {"checkpoint_every": 4, "optimizer": optimizer}
    _train(tiny_model_dir, tmp_path / "pieces", 6, schedule_steps=10, **pieces)
    state = load_checkpoint(tmp_path / "pieces").opt_state
    assert set(state) == set(new_state(optimizer, 1)) and all(t.abs().max() > 0 for t in state.values())
    _train(tiny_model_dir, tmp_path / "pieces", 10, **pieces)
    assert torch.equal(adapter_flat_b(tmp_path / "pieces"), b)
    assert (tmp_path / "pieces" / LOG_FILE).read_text() == (tmp_path / "whole" / LOG_FILE).read_text()


def test_sgd_is_todays_update_and_its_runs_fingerprint_is_unchanged(tiny_model_dir, tmp_path):
    d, q = 64, 3
    z = step_noise(torch.tensor([7]), q, d)
    g, lr = torch.tensor([0.5, -2.0, 0.25]), torch.tensor([0.01])
    b = torch.linspace(-1, 1, d)
    assert torch.equal(update("sgd", b, z, g, lr, {})[0], updated_b(b, z, g, lr))
    assert step_lr("sgd", 0.0123, 5) == 0.0123 and lr_factor("normalized", 0) == math.sqrt(1 - BETA2)
    _train(tiny_model_dir, tmp_path / "run", 2, checkpoint_every=2)
    assert "optimizer" not in load_checkpoint(tmp_path / "run").fingerprint  # older checkpoints still resume


def test_replay_carries_the_state_across_pieces_of_a_log():
    rng = np.random.default_rng(3)
    log = [
        {"step": k, "seed": 100 + k, "lr": 0.02, "eps": 0.01, "g": rng.normal(size=2).astype(np.float32).tolist()}
        for k in range(6)
    ]
    whole = replay_state(torch.zeros(32), log, "momentum")
    half = replay_state(torch.zeros(32), log[:3], "momentum")
    rest = replay_state(half[0], log[3:], "momentum", half[1])
    assert torch.equal(rest[0], whole[0]) and torch.equal(rest[1]["m"], whole[1]["m"])


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "normalized"])
@pytest.mark.parametrize("scale", [1e-6, 1.0, 1e6])
def test_every_step_moves_b_within_its_optimizers_bound(optimizer, scale):
    """|ΔB| per coordinate within ``step_bound`` for any g: ordinary ones, one huge g beside tiny ones, all tiny after
    large ones (what a forged log might try against normalized's running v) — the check the verifier's replay makes."""
    d, q, lr = 256, 4, 0.05
    rng = np.random.default_rng(int(scale))
    b, state, carried = torch.zeros(d), new_state(optimizer, d), 0.0
    for k in range(30):
        g = rng.normal(size=q) * scale
        if k % 10 == 7:
            g = np.array([scale * 1e3, 1e-30, -1e-30, 0.0])
        if k >= 20:
            g = g * 1e-12
        g = torch.from_numpy(g.astype(np.float32))
        z = step_noise(torch.tensor([k]), q, d)
        lr_k = step_lr(optimizer, lr, k)
        b_new, state = update(optimizer, b, z, g, torch.tensor([lr_k]), state)
        bound, carried = step_bound(optimizer, lr_k, g.numpy(), carried)
        assert float((b_new - b).abs().max()) <= bound * (1 + 1e-5) + 2.0**-22 * float(b_new.abs().max())
        if optimizer == "normalized":  # whatever the g
            assert bound == pytest.approx(lr_k * MAX_Z * 10, rel=1e-12)
        b = b_new


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "normalized"])
def test_a_checked_replay_refuses_a_step_beyond_the_bound(optimizer):
    """g near float32's largest: the step overflows B to infinity, which no bound admits."""
    log = [{"step": 0, "seed": 1, "lr": 1.0, "eps": 0.01, "g": [3e38, 3e38]}]
    with pytest.raises(OutOfBounds, match=f"step 0: B moved by .*{optimizer}'s bound"):
        replay_state(torch.zeros(64), log, optimizer, check=True)
    honest = [{"step": 0, "seed": 1, "lr": 0.05, "eps": 0.01, "g": [0.5, -0.25]}]
    b, _ = replay_state(torch.zeros(64), honest, optimizer, check=True)
    assert torch.equal(b, replay(torch.zeros(64), honest, optimizer))


def test_a_programs_optimizer_is_part_of_its_config_but_mezo_takes_sgd(tmp_path):
    config = TrainConfig(tmp_path, "sst2", tmp_path, tmp_path, q=4, batch_size=8, seq_len=16, optimizer="momentum")
    program = program_config(with_defaults(config), "classification", (1, 2), 1)
    assert program.optimizer == "momentum" and program.methods[-2:] == ["get_opt_state", "set_opt_state"]
    plain = program.model_copy(update={"optimizer": "sgd"})
    assert "optimizer" not in plain.model_dump() and "get_opt_state" not in plain.methods  # keys as before
    with pytest.raises(UsageError, match="--optimizer"):
        train(TrainConfig(tmp_path, "sst2", TRAIN, tmp_path / "o", method="mezo-lora", optimizer="momentum"))


class Session:
    """A program in the ExecuTorch runtime, as the agent's ``ProgramSession`` drives it."""

    def __init__(self, pte: Path, manifest) -> None:
        from device_agent.et_program import ProgramSession

        self.session = ProgramSession(pte, pte.parent / manifest.ptd.file)

    def step(self, batch, k: int, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
        from device_agent.batches import StepBatch

        args = (batch.input_ids.numpy(), batch.attention_mask.numpy(), batch.targets.numpy())
        losses, g = self.session.step(StepBatch(k, lr, *args), lr, EPS)
        return torch.from_numpy(losses), torch.from_numpy(g)


EPS = float(np.float32(1e-2))


def _eager_losses(eager, device, inputs: tuple, prior) -> torch.Tensor:
    """The eager step module's losses from the device's B and state, with ``prior`` in its loss."""
    with torch.no_grad():
        eager.set_lora_b(torch.from_numpy(device.session.get_b()))
        eager.set_opt_state(torch.from_numpy(device.session.get_state()))
        eager.candidate_prior = prior
        return eager(*inputs)[0].clone()


@pytest.mark.parametrize("optimizer", ["momentum", "normalized"])
def test_each_optimizers_program_is_its_eager_step_and_its_replay_bit_for_bit(request, optimizer):
    """10 steps in the .pte: each step's losses are the eager step module's from the same B and state (within the
    float32 bound across kernels), its update is the eager update of its own g (the replay, bit for bit: B and the
    state), and a run resumed after 5 steps (B, then the state rebuilt from the log) ends on the same bits.

    momentum: the suite's program (the federation tests train with it too); normalized: its program is this test's
    alone, so it is the one-layer model's at 4 columns, an export of about 0.7x the time (17 s against 24 s). The
    normalized program is also calibrated (``TINY_Q4_NORMALIZED.prior``): its losses are the eager step's with the
    prior, and not those without it."""
    from shared.hf_models import load_model
    from shared.program import build_step_module
    from tests.shared.test_program import _batches, assert_same_step_losses
    from tests.utils.programs import TINY_Q4_MOMENTUM, TINY_Q4_NORMALIZED

    model, factory = (
        ("tiny_model_dir", "program_factory")
        if optimizer == "momentum"
        else ("one_layer_model_dir", "one_layer_program_factory")
    )
    cfg = TINY_Q4_MOMENTUM if optimizer == "momentum" else TINY_Q4_NORMALIZED
    model_dir = request.getfixturevalue(model)
    pte, manifest = request.getfixturevalue(factory)(cfg)
    assert manifest.methods[-2:] == ["get_opt_state", "set_opt_state"]
    eager = build_step_module(load_model(model_dir)[0], cfg)
    device, d = Session(pte, manifest), manifest.lora_size
    device.session.set_b(np.full(d, 0.25, np.float32))
    device.session.set_state(np.ones(state_size(optimizer, d), np.float32))
    device.session.set_b(np.zeros(d, np.float32))  # setting B starts the state again
    assert not device.session.get_state().any()
    batches, log = _batches(cfg, eager.model.config.vocab_size)[:10], []
    for k, batch in enumerate(batches):
        lr = step_lr(optimizer, float(np.float32(0.2)), k)
        inputs = (batch.input_ids, batch.attention_mask, batch.targets, torch.tensor([k]), torch.tensor([lr]))
        want = _eager_losses(eager, device, (*inputs, torch.tensor([EPS])), eager.candidate_prior)
        if cfg.prior:  # the prior is in the program's loss: without it the eager step's losses are others
            plain = _eager_losses(eager, device, (*inputs, torch.tensor([EPS])), None)
            assert (plain - want).abs().min() > 100 * float(want.abs().max()) * 2**-23
            eager.candidate_prior = torch.tensor(cfg.prior)
        losses, g = device.step(batch, k, lr)
        assert_same_step_losses(losses, want, eager.model.config)
        log.append(log_record(k, k, lr, EPS, g, losses))
    b, state = torch.from_numpy(device.session.get_b()), torch.from_numpy(device.session.get_state())
    replayed, kept = replay_state(torch.zeros(d), log, optimizer, check=True)
    assert b.abs().max() > 0 and torch.equal(replayed, b) and torch.equal(flat_state(kept), state)
    assert not torch.equal(replay(torch.zeros(d), log), b)
    resumed = Session(pte, manifest)
    half_b, half_state = replay_state(torch.zeros(d), log[:5], optimizer)
    resumed.session.set_b(half_b.numpy())
    resumed.session.set_state(flat_state(half_state).numpy())
    for k, batch in enumerate(batches[5:], start=5):
        resumed.step(batch, k, log[k]["lr"])
    assert resumed.session.get_b().tobytes() == b.numpy().tobytes()
