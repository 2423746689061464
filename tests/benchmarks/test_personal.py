"""The personalization table (benchmarks/personal.py) end to end on the tiny model and the shipped sample's three
users: every column measured for every user from real steps, and the columns that must agree agree bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

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
        loss, seconds = row["loss"], row["device_s"]
        assert all(loss[k] != loss["a"] for k in "bcde")  # each adapter moved the held-out loss
        assert loss["d"] != loss["c"]  # (d) started from the population, (c) from the base
        assert seconds["a"] == 0 and all(seconds[k] > 0 for k in "bcde")
    assert result["config"]["answer_len"] == 34  # the tiny tokenizer's longest line of the sample
    assert result["population_device_s"] == sum(r["device_s"]["b"] for r in result["rows"])
    medians = {k: c["loss"]["median"] for k, c in result["columns"].items()}
    assert medians["a"] == sorted(r["loss"]["a"] for r in result["rows"])[1]
    assert "| (d) personal from population |" in capsys.readouterr().out
    assert (tmp_path / "personal.md").read_text().startswith("3 users;")


def test_without_rounds_the_population_is_the_base(tiny_model_dir: Path, tmp_path: Path) -> None:
    """No round: (b) is the base model and (d), from it, the very steps of (c)."""
    result = run(tiny_model_dir, tmp_path, "--rounds", "0", "--users", "2")
    assert result["users"] == 2
    for row in result["rows"]:
        assert row["loss"]["b"] == row["loss"]["a"] and row["loss"]["d"] == row["loss"]["c"] != row["loss"]["a"]
