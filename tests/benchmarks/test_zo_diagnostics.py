"""The zeroth-order diagnostics (benchmarks/zo_diagnostics.py) on the tiny model: measuring does not move the run,
the modes change only what they say, and the figures are what their definitions give."""

from __future__ import annotations

import json
import math
from pathlib import Path

from benchmarks.zo_diagnostics import main
from shared.train import TrainConfig, train

SMALL = ["--steps", "4", "--every", "2", "--eval-every", "2", "--n-train", "48", "--n-val", "8", "--n-test", "16"]


def test_measuring_leaves_the_run_as_the_job_runs_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The zo mode's steps are a plain run's, bit for bit (the backward passes touch neither B nor the batches);
    exact and oracle with no tilt are one run; each row's figures hold their definitions."""
    out = tmp_path / "diag"
    results = main(["--model", str(tiny_model_dir), *SMALL, "--modes", "zo,exact", "--out", str(out)])
    zo, exact = results
    plain = train(
        TrainConfig(
            model=tiny_model_dir,
            task="sst2",
            train=out / "data" / "sst2" / "train.jsonl",
            eval=out / "data" / "sst2" / "test.jsonl",
            out=tmp_path / "plain",
            method="mobizo",
            steps=4,
            eval_every=2,
            device="cpu",
        ),
        progress=False,
    )
    assert [e["accuracy"] for e in zo["eval"]] == [e["accuracy"] for e in plain["eval"]]
    assert [e["loss"] for e in zo["eval"]] == [e["loss"] for e in plain["eval"]]
    assert [row["step"] for row in zo["diagnostics"]] == [0, 2]
    first_zo, first_exact = zo["diagnostics"][0], exact["diagnostics"][0]
    assert first_exact["fd_relative_error"] == 0 and first_exact["cos_estimate"] == first_exact["cos_exact"]
    assert first_zo["cos_exact"] == first_exact["cos_exact"]  # the same B, batch and z at step 0
    assert 0 < first_zo["fd_relative_error"] < 1  # finite differences near, not equal to, the exact derivatives
    assert first_zo["sqrt_q_over_d"] == math.sqrt(zo["config"]["q"] / zo["d"])
    untilted = main(
        ["--model", str(tiny_model_dir), *SMALL, "--modes", "oracle", "--rho", "0", "--out", str(out / "o")]
    )
    assert untilted[0]["eval"] == exact["eval"] and untilted[0]["diagnostics"] == exact["diagnostics"]
    assert json.loads((out / "zo.json").read_text())["mode"] == "zo"  # a finished mode is kept, not run again
