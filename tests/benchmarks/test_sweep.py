"""benchmarks/sweep.py on the tiny model: a variant's settings reach its runs over a job's defaults, runs in worker
processes give the same curves as runs in this one, a second start skips what finished, and the table's figures are
the runs'."""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest

from benchmarks.sweep import main, read_results
from shared import defaults

SMALL = ["--steps", "4", "--eval-every", "2", "--n-train", "32", "--n-val", "16", "--n-test", "16", "--seq-len", "64"]


def _args(model: Path, out: Path, *extra: str) -> list[str]:
    return ["--model", str(model), "--out", str(out), *SMALL, *extra]


def _curves(out: Path) -> dict:
    return {  # device-seconds are timings: the curves compared are the steps' accuracies
        (r["variant"], r["seed"]): [(p["step"], p["accuracy"]) for p in r["curve"]]
        for r in read_results(out / "results")
    }


def test_variants_over_seeds_run_resume_and_tabulate(tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "sweep"
    variants = ["--variants", "defaults,rank-2-lr-6e-2", "--seeds", "0,1"]
    assert main(_args(tiny_model_dir, out, *variants, "--workers", "2")) == 0
    curves = _curves(out)
    assert sorted(curves) == [("defaults", 0), ("defaults", 1), ("rank-2-lr-6e-2", 0), ("rank-2-lr-6e-2", 1)]
    assert all([p[0] for p in curve] == [0, 2, 4] for curve in curves.values())
    for r in read_results(out / "results"):  # device-seconds: steps x the run's median step time
        assert [p["device_s"] for p in r["curve"]] == [p["step"] * r["step_time_s"] for p in r["curve"]]

    job = defaults.CLASSIFICATION  # the defaults variant is a job's: q 4 at batch 16, the objective's tuned values
    ran = {
        v: json.loads((out / "runs" / f"{v}-seed0" / "metrics.json").read_text())
        for v in ("defaults", "rank-2-lr-6e-2")
    }
    assert (ran["defaults"]["q"], ran["defaults"]["batch_size"]) == (4, 16)
    got = {k: ran["defaults"][k] for k in ("lr", "eps", "rank", "lr_schedule", "objective")}
    assert got == {
        "lr": job.lr,
        "eps": job.eps,
        "rank": job.rank,
        "lr_schedule": job.lr_schedule,
        "objective": "classification",
    }
    assert (ran["rank-2-lr-6e-2"]["rank"], ran["rank-2-lr-6e-2"]["lr"]) == (2, 6e-2)
    assert ran["rank-2-lr-6e-2"]["eps"] == job.eps
    table = capsys.readouterr().out
    assert (out / "last-step.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "device-seconds.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Started again with one run gone (its result and its checkpoints): only that run is repeated, in this process
    # instead of a worker's, and it ends on the same curve.
    first = (out / "results" / "defaults-seed1.json").stat().st_mtime_ns
    (out / "results" / "rank-2-lr-6e-2-seed1.json").unlink()
    shutil.rmtree(out / "runs" / "rank-2-lr-6e-2-seed1")
    assert main(_args(tiny_model_dir, out, *variants, "--workers", "1")) == 0
    assert "1 runs to go (3 finished before)" in capsys.readouterr().err
    assert (out / "results" / "defaults-seed1.json").stat().st_mtime_ns == first
    assert _curves(out) == curves

    # A row: each seed's last-step accuracy, their mean and its gain over step 0.
    row = next(line for line in table.splitlines() if line.startswith("rank-2-lr-6e-2"))
    last = [curves[("rank-2-lr-6e-2", s)][-1][1] for s in (0, 1)]
    base = statistics.mean(curves[("rank-2-lr-6e-2", s)][0][1] for s in (0, 1))
    mean = statistics.mean(last)
    assert " ".join(f"{a:.3f}" for a in last) in row
    assert f"{mean:.3f} {100 * (mean - base):+6.1f}" in row


def test_an_unknown_variant_is_named(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--model", "m", "--out", "o", "--variants", "defaults,rank-9"])
    assert "--variants: unknown rank-9" in capsys.readouterr().err


def test_the_device_seconds_table_reads_each_run_at_the_budget() -> None:
    """A run's figure at the budget is its last evaluation within it; the row gives the seeds' means of that, of the
    last and of each seed's best, and the gain at the budget over step 0."""
    from benchmarks.sweep import at_budget, budget_table

    def run(seed: int, accuracies: list[float]) -> dict:
        curve = [{"step": 2 * i, "accuracy": a, "device_s": 2 * i * 1.5} for i, a in enumerate(accuracies)]
        return {"variant": "v", "seed": seed, "steps": 4, "step_time_s": 1.5, "curve": curve}

    results = [run(0, [0.5, 0.7, 0.6]), run(1, [0.5, 0.6, 0.8])]
    assert [at_budget(r, 4.0) for r in results] == [0.7, 0.6] and at_budget(results[0], 2.9) == 0.5
    row = budget_table(results, ["v", "absent"], 4.0).splitlines()[-1].split()
    assert row == ["v", "1.500", "4", "0.650", "+15.0", "0.700", "0.750", "2"]


def test_a_first_order_variant_at_equal_forwards_takes_two_thirds_of_the_steps() -> None:
    """``--equal-forwards``: a first-order variant that names no steps costs the zeroth-order runs' forward passes (a
    MobiZO step two forwards of its batch, a first-order step three); a zeroth-order variant and one that names its
    steps are left as they are."""
    from benchmarks.sweep import equal_forward_steps, variant_settings

    job = {"steps": 20_000, "equal_forwards": True}
    assert equal_forward_steps(20_000) == 13_334 and equal_forward_steps(3) == 2
    assert variant_settings(job | {"variant": "fo-lora-lr-1.6e-1"})["steps"] == 13_334
    assert variant_settings(job | {"variant": "defaults"})["steps"] == 20_000
    assert variant_settings(job | {"variant": "long-lr-2e-2"})["steps"] == 2000
    assert variant_settings(job | {"variant": "fo-lora-lr-1.6e-1", "equal_forwards": False})["steps"] == 20_000
