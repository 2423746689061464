"""benchmarks/peer.py's table: each method's row holds its runs' means (at the budget, last, gain over step 0), its
program's memory against the inference forward of the same rows, and what it uploads. (That both programs train is
tests/shared/test_fo_program.py's subject and, for mobizo's, the suite's.)"""

from __future__ import annotations

import statistics

from benchmarks.peer import METHODS, UPLOADS, summary, table


def _run(seed: int, step_s: float, accuracies: list[float]) -> dict:
    curve = [{"step": 50 * i, "accuracy": a, "device_s": 50 * i * step_s} for i, a in enumerate(accuracies)]
    return {"variant": "v", "seed": seed, "steps": 50 * (len(accuracies) - 1), "step_time_s": step_s, "curve": curve}


def test_each_method_gets_its_runs_means_its_memory_ratio_and_its_upload() -> None:
    runs = {
        "mobizo": [_run(0, 1.0, [0.78, 0.80, 0.81]), _run(1, 1.2, [0.78, 0.79, 0.83])],
        "first-order": [_run(0, 4.0, [0.78, 0.84, 0.85])],
    }
    measured = {
        method: {
            "export_s": 60.0,
            "pte_bytes": 2e6,
            "ptd_bytes": 5.4e8,
            "rows": rows,
            "step_mb": step,
            "inference_mb": 900.0,
        }
        for method, rows, step in (("mobizo", 32, 990.0), ("first-order", 16, 7200.0))
    }
    text = table(measured, runs, budget=100.0)
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines()[2:]}
    assert list(rows) == list(METHODS)
    mobizo = summary(runs["mobizo"], 100.0)
    # within 100 device-seconds: seed 0 reached step 100 (0.81), seed 1 only step 50 (0.79)
    assert mobizo["at_budget"] == statistics.mean([0.81, 0.79])
    assert mobizo["last"] == statistics.mean([0.81, 0.83]) and mobizo["start"] == 0.78
    assert (
        f"{mobizo['at_budget']:.3f} | {mobizo['last']:.3f} (110) | {100 * (mobizo['last'] - 0.78):+.1f}"
        in rows["mobizo"]
    )
    assert (
        "| 990 | 900 (32 rows) | 1.10 |" in rows["mobizo"] and "| 7200 | 900 (16 rows) | 8.00 |" in rows["first-order"]
    )
    assert all(UPLOADS[method] in rows[method] for method in METHODS)
