"""Resuming: the log is cut back to the checkpoint, a torn last line is dropped, a checkpoint ahead of the log gives
way to the replay of the log, one of another run is not used; an optimizer's state is rebuilt from the log's kept
lines."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from device_agent.checkpoint import Checkpoint, save_checkpoint
from device_agent.trainlog import LogWriter, read_complete, resume_point
from shared.replay import replay, replay_state
from shared.train_log import log_record, parse_log

B = np.arange(6, dtype=np.float32)


@pytest.fixture
def log(tmp_path: Path) -> Path:
    path = tmp_path / "train_log.jsonl"
    with LogWriter(path) as writer:
        for step in range(5):
            writer.write(log_record(step, 100 + step, 0.5, 0.01, [0.25 * step], [1.0, 2.0]))
    return path


def test_written_log_is_a_valid_training_log(log: Path) -> None:
    assert [r["seed"] for r in parse_log(log.read_text())] == [100, 101, 102, 103, 104]


def test_checkpoint_behind_the_log_cuts_the_log_back(log: Path, tmp_path: Path) -> None:
    save_checkpoint(tmp_path / "c", Checkpoint("run", 3, B))
    start, b, state = resume_point(log, tmp_path / "c", "run", B)
    assert start == 3 and b.tobytes() == B.tobytes() and state is None  # sgd keeps no state
    assert [r["step"] for r in read_complete(log)] == [0, 1, 2]


def test_torn_last_line_is_dropped(log: Path, tmp_path: Path) -> None:
    with open(log, "a") as f:
        f.write('{"step": 5, "seed": 1')  # a kill in the middle of a write
    assert len(read_complete(log)) == 5
    save_checkpoint(tmp_path / "c", Checkpoint("run", 5, B))
    assert resume_point(log, tmp_path / "c", "run", B)[0] == 5
    assert log.read_text().count("\n") == 5 and log.read_text().endswith("}\n")


def test_checkpoint_ahead_of_the_log_gives_way_to_the_replay_of_the_log(log: Path, tmp_path: Path) -> None:
    save_checkpoint(tmp_path / "c", Checkpoint("run", 7, B))  # a runner that outlived the agent by two steps
    expected = replay(torch.from_numpy(B), read_complete(log)).numpy()
    start, b, state = resume_point(log, tmp_path / "c", "run", B)
    assert start == 5 and b.tobytes() == expected.tobytes() and not np.array_equal(b, B)
    assert len(read_complete(log)) == 5


@pytest.mark.parametrize(
    "checkpoint, init_b",
    [(Checkpoint("run", 7, B), None), (Checkpoint("other-run", 2, B), B), (None, B)],
    ids=["ahead, start unknown", "another run's", "none"],
)
def test_unusable_or_missing_checkpoint_starts_over(log: Path, tmp_path: Path, checkpoint, init_b) -> None:
    if checkpoint is not None:
        save_checkpoint(tmp_path / "c", checkpoint)
    assert resume_point(log, tmp_path / "c", "run", init_b) == (0, None, None)
    assert log.read_text() == ""


def test_no_log_yet(tmp_path: Path) -> None:
    assert read_complete(tmp_path / "none.jsonl") == []
    assert resume_point(tmp_path / "none.jsonl", tmp_path / "c", "run", B) == (0, None, None)


@pytest.mark.parametrize("ahead", [False, True])
def test_an_optimizers_state_is_rebuilt_from_the_kept_lines(log: Path, tmp_path: Path, ahead: bool) -> None:
    """The checkpoint holds B; the momentum it was trained with is the replay's of the steps before it."""
    records = read_complete(log)
    save_checkpoint(tmp_path / "c", Checkpoint("run", 7 if ahead else 3, B))
    kept = 5 if ahead else 3
    want_b, want_state = replay_state(torch.from_numpy(B), records[:kept], "momentum")
    start, b, state = resume_point(log, tmp_path / "c", "run", B, "momentum")
    assert start == kept and state.tobytes() == want_state["m"].numpy().tobytes() and np.abs(state).max() > 0
    assert b.tobytes() == (want_b.numpy() if ahead else B).tobytes()  # the checkpoint's B where it covers the log


def test_an_optimizers_run_without_its_start_starts_over(log: Path, tmp_path: Path) -> None:
    save_checkpoint(tmp_path / "c", Checkpoint("run", 3, B))
    assert resume_point(log, tmp_path / "c", "run", None, "normalized") == (0, None, None)
