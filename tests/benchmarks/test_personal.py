"""The personalization table (benchmarks/personal.py) end to end on the tiny model and the shipped sample's three
users: every column measured for every user from real steps, and the columns that must agree agree bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.personal import main

SMALL = ["--steps", "2", "--local-steps", "1", "--per-round", "2", "--seq-len", "48", "--lr", "0.05"]
SMALL += ["--rank", "2", "--batch-size", "4", "--q", "2", "--fo-lr", "0.05"]


def run(tiny_model_dir: Path, out: Path, *extra: str) -> dict:
    main(["--model", str(tiny_model_dir), *SMALL, *extra, "--out", str(out)])
    return json.loads((out / "personal.json").read_text())


def test_every_column_is_measured_for_every_user(tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    result = run(tiny_model_dir, tmp_path, "--rounds", "1")
    assert [r["user"] for r in result["rows"]] == ["CORIOLANUS", "MARCIUS", "MENENIUS"] and result["users"] == 3
    for row in result["rows"]:
        loss = row["loss"]
        assert all(loss[k] != loss["a"] for k in "bcde")  # each adapter moved the held-out loss
        assert loss["d"] != loss["c"]  # (d) started from the population, (c) from the base
        assert row["steps"] == {"c": 2, "d": 2, "e": 2, "f": 3}  # first-order: 2/3 of the steps, rounded up
        served = [loss["b"]] + [night["served"] for night in row["nights"]]
        for before, night, after in zip(served[:-1], row["nights"], served[1:], strict=True):
            assert after == (night["loss"] if night["loss"] < before else before)  # promoted only when it improves
            assert night["promoted"] == (night["loss"] < before)
        assert loss["f"] == served[-1]
    columns, step_s = result["columns"], result["step_s"]
    assert step_s["zo"] > 0 and step_s["fo"] > 0
    assert columns["a"]["device_s_per_user"] == 0 and columns["e"]["device_s_per_user"] == 2 * step_s["fo"]
    assert columns["b"]["steps_per_user"] == 2 / 3  # one round of 2 users × 1 local step, over 3 users
    assert result["config"]["answer_len"] == 34  # the tiny tokenizer's longest line of the sample
    medians = {k: c["loss"]["median"] for k, c in columns.items()}
    assert medians["a"] == sorted(r["loss"]["a"] for r in result["rows"])[1]
    out = capsys.readouterr().out
    assert "| (d) personal from population |" in out and "| 3 |" in out  # the third night's row
    assert (tmp_path / "personal.md").read_text().startswith("3 users;")


def test_a_stopped_run_continues_to_the_same_figures(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The progress file keeps the rounds' logs and each user's row: a rerun rebuilds the population by replay and
    measures only the users left, to the figures of a run that was never stopped; another configuration is
    refused."""
    whole = run(tiny_model_dir, tmp_path / "whole", "--rounds", "1")
    progress = tmp_path / "cut" / "progress.jsonl"
    run(tiny_model_dir, tmp_path / "cut", "--rounds", "1")
    lines = progress.read_text().splitlines()
    kinds = [json.loads(line)["kind"] for line in lines]
    assert kinds == ["config", "calibration", "round", "user", "user", "user"]
    progress.write_text("\n".join(lines[:4]) + "\n" + lines[4][:20])  # stopped while writing the second user
    resumed = run(tiny_model_dir, tmp_path / "cut", "--rounds", "1")
    assert resumed["rows"] == whole["rows"]
    assert [json.loads(line)["kind"] for line in progress.read_text().splitlines()].count("calibration") == 2
    with pytest.raises(SystemExit, match="--out: .* another configuration .*steps"):
        run(tiny_model_dir, tmp_path / "cut", "--rounds", "1", "--steps", "3")


def test_without_rounds_the_population_is_the_base(tiny_model_dir: Path, tmp_path: Path) -> None:
    """No round: (b) is the base model and (d), from it, the very steps of (c)."""
    result = run(tiny_model_dir, tmp_path, "--rounds", "0", "--users", "2")
    assert result["users"] == 2
    for row in result["rows"]:
        assert row["loss"]["b"] == row["loss"]["a"] and row["loss"]["d"] == row["loss"]["c"] != row["loss"]["a"]
