"""Resumable training (``--checkpoint-every``): a run cut in pieces ends exactly where an uninterrupted run ends.

Step k's batch and seed are pure functions of (run seed, k), so a resumed run repeats the same operations on the
same numbers; the checks are exact (same process, same kernels, same thread count).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shared.checkpoint import CHECKPOINT_DIR, load_checkpoint
from shared.errors import UsageError
from shared.train import LOG_FILE, TrainConfig, train
from tests.shared.test_train import HELD_OUT, TRAIN, adapter_flat_b

RUN = {"task": "sst2", "train": TRAIN, "eval": HELD_OUT, "limit_train": 64, "limit_eval": 16, "device": "cpu"}
RUN |= {"method": "mobizo", "q": 2, "batch_size": 4, "lr": 1e-2, "eval_every": 2, "checkpoint_every": 2}


def _train(model: Path, out: Path, steps: int, **changes) -> dict:
    return train(TrainConfig(model=model, out=out, steps=steps, **RUN | changes), progress=False)


def test_a_run_in_pieces_equals_one_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    """SST-2's default schedule decays over the run's steps: a first piece of 4 steps is the opening of the
    6-step run (``schedule_steps``), and the same --out continues it to the very bits of one run."""
    whole = _train(tiny_model_dir, tmp_path / "whole", 6)
    assert whole["lr_schedule"] == "cosine"
    _train(tiny_model_dir, tmp_path / "pieces", 4, schedule_steps=6)
    assert load_checkpoint(tmp_path / "pieces").step == 4
    pieces = _train(tiny_model_dir, tmp_path / "pieces", 6)
    assert torch.equal(adapter_flat_b(tmp_path / "pieces"), adapter_flat_b(tmp_path / "whole"))
    for key in ("losses", "eval", "best_eval"):
        assert pieces[key] == whole[key], key
    assert [e["step"] for e in pieces["eval"]] == [0, 2, 4, 6]
    log = (tmp_path / "pieces" / LOG_FILE).read_text()
    assert log == (tmp_path / "whole" / LOG_FILE).read_text() and len(log.splitlines()) == 6


def test_a_decaying_run_is_not_extended_and_a_constant_one_is(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A longer --steps would change the lr of a cosine run's remaining steps: refused, naming --steps. A constant
    schedule's lr does not depend on the steps: its run extends."""
    _train(tiny_model_dir, tmp_path / "cosine", 2)
    with pytest.raises(UsageError, match="--steps.*cosine schedule spans 2 steps"):
        _train(tiny_model_dir, tmp_path / "cosine", 4)
    _train(tiny_model_dir, tmp_path / "constant", 2, lr_schedule="constant")
    assert _train(tiny_model_dir, tmp_path / "constant", 4, lr_schedule="constant")["steps"] == 4


def test_the_checkpoint_keeps_the_best_evaluation(tiny_model_dir: Path, tmp_path: Path) -> None:
    metrics = _train(tiny_model_dir, tmp_path, 4)
    checkpoint = load_checkpoint(tmp_path)
    best = max(metrics["eval"], key=lambda e: e["accuracy"])  # max keeps the first of equals, as the run does
    assert checkpoint.best == best == metrics["best_eval"]
    if best["step"] == 0:
        assert torch.count_nonzero(checkpoint.best_b) == 0
    assert checkpoint.step == 4 and torch.equal(checkpoint.b, adapter_flat_b(tmp_path))


def test_a_checkpoint_of_another_run_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    _train(tiny_model_dir, tmp_path, 2)
    with pytest.raises(UsageError, match="--out.*differs in lr"):
        _train(tiny_model_dir, tmp_path, 4, lr=2e-2)
    with pytest.raises(UsageError, match="--steps"):
        _train(tiny_model_dir, tmp_path, 1)


def test_mezo_full_is_not_checkpointed(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="--checkpoint-every"):
        _train(tiny_model_dir, tmp_path, 2, method="mezo", q=1)


def test_the_checkpoint_is_written_whole(tiny_model_dir: Path, tmp_path: Path) -> None:
    _train(tiny_model_dir, tmp_path, 3)  # checkpoints at 2 and at the end (3)
    folder = tmp_path / CHECKPOINT_DIR
    assert sorted(p.name for p in folder.iterdir()) == ["b.safetensors", "state.json"]
    assert json.loads((folder / "state.json").read_text())["step"] == 3
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left behind
