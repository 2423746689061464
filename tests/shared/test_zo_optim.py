"""The ZO optimizers (``shared.zo_optim``): each run's log replays to its B bit for bit (the state rebuilt from the
logged g), a run in pieces (the state in the checkpoint) is the uninterrupted run, ``sgd`` is today's update, and
``normalized`` cannot move B further than its bound whatever a log says."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from shared.checkpoint import load_checkpoint
from shared.errors import UsageError
from shared.replay import replay, replay_state
from shared.schedule import lr_at
from shared.train import LOG_FILE, TrainConfig, program_config, train
from shared.train_log import read_log
from shared.zo import step_noise, updated_b
from shared.zo_optim import BETA2, lr_factor, new_state, step_lr, update
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


@pytest.mark.parametrize("scale", [1e-6, 1.0, 1e6])
def test_normalized_moves_b_no_further_than_its_bound_whatever_the_g(scale):
    """|ΔB| ≤ lr·10·√q·max|z| per coordinate and step, for any g (the verifier's bound for a forged log)."""
    d, q, lr = 256, 4, 0.05
    rng = np.random.default_rng(int(scale))
    b, state = torch.zeros(d), new_state("normalized", d)
    for k in range(20):
        z = step_noise(torch.tensor([k]), q, d)
        g = torch.from_numpy((rng.normal(size=q) * scale * (10.0 if k == 19 else 1.0)).astype(np.float32))
        b_new, state = update("normalized", b, z, g, torch.tensor([step_lr("normalized", lr, k)]), state)
        assert float((b_new - b).abs().max()) <= lr * 10 * math.sqrt(q) * float(z.abs().max()) * (1 + 1e-6)
        b = b_new


def test_an_optimizer_other_than_sgd_runs_eagerly_only(tmp_path):
    config = TrainConfig(tmp_path, "sst2", tmp_path, tmp_path, q=4, batch_size=8, seq_len=16, optimizer="momentum")
    with pytest.raises(UsageError, match="--optimizer"):
        program_config(config, "classification", (1, 2), 1)
    with pytest.raises(UsageError, match="--optimizer"):
        train(TrainConfig(tmp_path, "sst2", TRAIN, tmp_path / "o", method="mezo-lora", optimizer="momentum"))
