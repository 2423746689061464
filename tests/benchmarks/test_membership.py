"""benchmarks/membership.py on the tiny model: a non-private log with one example per query gives the canary away
(its own losses, to the bit); a private log carries no losses to match, and the g attack is scored on both."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.membership import advantage, chance_line, main


def test_the_advantage_is_the_best_thresholds_tpr_minus_fpr() -> None:
    assert advantage([3.0, 4.0], [1.0, 2.0]) == 1.0
    assert advantage([1.0, 2.0], [3.0, 4.0]) == 0.0  # reversed: 'in' never scores higher
    assert advantage([1.0, 4.0], [2.0, 3.0]) == 0.5  # the threshold 4 catches one of two, no false positive
    line = chance_line(8)
    assert 0.25 < line < 0.75  # two groups of 8 shuffled: separated by 0.5 or more now and then, not by chance alone


def test_an_open_log_gives_the_canary_away_and_a_private_one_has_no_losses(tmp_path: Path, capsys) -> None:
    argv = ["--out", str(tmp_path), "--trials", "3", "--steps", "8", "--n-train", "8"]
    assert main(argv) == 0
    rows = {(r["setting"], r["attack"]): r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    assert set(rows) == {("not private", "losses"), ("not private", "g"), ("epsilon 8", "g")}  # no losses to match
    leak = rows["not private", "losses"]
    # One example per query: a run that drew the canary logged the canary's own losses, as the attacker computes them
    # (the distance is 0; the score's cap is 16), and no run without it comes within 1e-4.
    assert leak["scores_in"] == [16.0] * 3 and max(leak["scores_out"]) < 4
    assert leak["advantage"] == 1.0
    for run in (tmp_path / "private").iterdir():
        if run.name.endswith("-in"):
            assert '"losses"' not in (run / "train_log.jsonl").read_text()
    printed = capsys.readouterr().out
    assert main(argv) == 0  # every run is read back: the same table
    assert capsys.readouterr().out.splitlines()[-3:] == printed.splitlines()[-3:]
