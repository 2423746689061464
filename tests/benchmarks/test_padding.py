"""benchmarks/padding.py on the tiny model's program: the ways it times take the same step, and a baseline of
another config is refused (its steps would not be the same job's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.padding import main
from tests.utils.programs import TINY_Q1, TINY_Q4


def test_a_baseline_program_is_timed_beside_the_two_widths(program_factory, tmp_path: Path, capsys) -> None:
    pte, manifest = program_factory(TINY_Q4)
    out = tmp_path / "padding.json"
    main(["--program", str(pte), "--baseline", str(pte), "--steps", "3", "--repeats", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    # The same program as its own baseline: the same bytes from the same B on the same rows, bit for bit.
    assert result["baseline_losses_max_rel_diff"] == 0.0
    assert all(result[f"{way}_step_s"] > 0 for way in ("full", "fitted", "baseline"))
    assert result["fitted_columns_range"][1] <= manifest.config.seq_len
    assert "fitted against the baseline" in capsys.readouterr().out

    other, _ = program_factory(TINY_Q1)
    with pytest.raises(SystemExit, match="another config than --program's"):
        main(["--program", str(pte), "--baseline", str(other), "--steps", "1", "--repeats", "1"])
