"""benchmarks/privacy.py on the tiny model: a row per epsilon, the private ones with their noise and the epsilon
they spent, logs without losses, and a second run reads the finished runs back."""

from __future__ import annotations

import json
import math
from pathlib import Path

from benchmarks.privacy import main


def test_each_epsilon_gets_its_row_and_a_rerun_reads_them_back(tmp_path: Path, capsys) -> None:
    argv = ["--out", str(tmp_path), "--steps", "4", "--n-train", "32", "--n-eval", "8", "--epsilons", "inf", "3"]
    assert main(argv) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["epsilon"] for r in rows] == [math.inf, 3.0]
    plain, private = rows
    assert plain["noise_multiplier"] is None and plain["epsilon_spent"] is None
    assert private["noise_multiplier"] > 0 and private["epsilon_spent"] <= 3.0
    assert all(0 <= r["accuracy_after"] <= 1 for r in rows)
    log = (tmp_path / "eps-3" / "train_log.jsonl").read_text().splitlines()
    assert len(log) == 4 and not any("losses" in json.loads(line) for line in log)
    first = capsys.readouterr().out
    assert main(argv) == 0  # finished runs are read back, not trained again
    assert capsys.readouterr().out == first


def test_the_clip_only_row_is_the_private_path_without_its_noise(tmp_path: Path) -> None:
    clip = 0.05
    argv = ["--out", str(tmp_path), "--steps", "3", "--n-train", "32", "--n-eval", "8", "--epsilons", "inf"]
    assert main([*argv, "--clip-only", "--clip", str(clip)]) == 0
    plain, clipped = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert plain["epsilon"] == math.inf and clipped["epsilon"] == "clip"
    assert clipped["noise_multiplier"] == 0 and clipped["noise_std"] == 0
    log = [json.loads(line) for line in (tmp_path / "clip-only" / "train_log.jsonl").read_text().splitlines()]
    g = [x for line in log for x in line["g"]]
    assert len(log) == 3 and not any("losses" in line for line in log)
    # without noise each g is a mean of differences clipped to [-C, C]; the plain run's are not clipped
    assert max(map(abs, g)) <= clip * (1 + 1e-6)
    plain_log = [json.loads(line) for line in (tmp_path / "eps-inf" / "train_log.jsonl").read_text().splitlines()]
    assert max(abs(x) for line in plain_log for x in line["g"]) > clip
