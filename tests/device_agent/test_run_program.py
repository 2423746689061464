"""``mobizo run-program``: a program run on local data as a device runs it.

Its log replays to its adapter bit for bit (``mobizo replay``), its losses are ``mobizo train --method mobizo``'s
on the same data and seeds, and its evaluation through the program's ``evaluate`` method is ``mobizo eval``'s
(PyTorch, base model + adapter).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoConfig

from mobizo.cli import main
from shared.adapter import read_adapter
from shared.schedule import lrs
from shared.tasks import task_data_dir
from tests.utils.programs import TINY_Q4
from tests.utils.tolerance import b_drift, loss_rtol, losses_atol_with_drift

pytestmark = pytest.mark.slow  # the session's program export, and a mobizo train run
STEPS, LR, EPS, SEED = 12, "0.5", "0.05", 7
# Both runs follow the same lr schedule: warm-up, then a linear decay (each step's lr from its batch record).
SCHEDULE = ["--lr-schedule", "linear", "--warmup-steps", "2", "--lr-floor", "0.1"]


def first_lines(source: Path, dest: Path, count: int) -> Path:
    with open(source) as f:
        dest.write_text("".join(itertools.islice(f, count)))
    return dest


@pytest.fixture(scope="module")
def sst2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("sst2")
    data = task_data_dir() / "sst2"
    return first_lines(data / "train.jsonl", folder / "train.jsonl", 40), first_lines(
        data / "validation.jsonl", folder / "eval.jsonl", 24
    )


@pytest.fixture(scope="module")
def device_run(program_factory, sst2, tmp_path_factory: pytest.TempPathFactory) -> Path:
    pte, _ = program_factory(TINY_Q4)
    out = tmp_path_factory.mktemp("run")
    args = [
        "run-program",
        "--program",
        str(pte),
        "--task",
        "sst2",
        "--train",
        str(sst2[0]),
        "--eval",
        str(sst2[1]),
        "--steps",
        str(STEPS),
        "--lr",
        LR,
        "--eps",
        EPS,
        "--seed",
        str(SEED),
        *SCHEDULE,
        "--out",
        str(out),
    ]
    assert main(args) == 0
    return out


def test_outputs_and_metrics(device_run: Path) -> None:
    metrics = json.loads((device_run / "metrics.json").read_text())
    for key in ("method", "q", "batch_size", "steps", "lr", "eps", "seed", "losses", "step_time_s", "peak_rss_mb"):
        assert key in metrics, key
    assert (metrics["q"], metrics["batch_size"], metrics["steps"], metrics["seed"]) == (4, 8, STEPS, SEED)
    assert (metrics["lr_schedule"], metrics["warmup_steps"], metrics["lr_floor"]) == ("linear", 2, 0.1)
    assert len(metrics["losses"]) == STEPS and metrics["backend"] == "executorch"
    assert [e["step"] for e in metrics["eval"]] == [0, STEPS]
    assert all(0 <= e["accuracy"] <= 1 for e in metrics["eval"])
    assert len((device_run / "train_log.jsonl").read_text().splitlines()) == STEPS


def test_replay_of_the_log_is_the_adapter(device_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = [
        "replay",
        "--init",
        str(device_run / "init_adapter"),
        "--log",
        str(device_run / "train_log.jsonl"),
        "--out",
        str(tmp_path / "replayed"),
        "--compare",
        str(device_run / "adapter"),
    ]
    assert main(args) == 0
    assert "identical to" in capsys.readouterr().out


def test_losses_match_mobizo_train(device_run: Path, sst2, tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = TINY_Q4
    args = [
        "train",
        "--model",
        str(tiny_model_dir),
        "--task",
        "sst2",
        "--train",
        str(sst2[0]),
        "--method",
        "mobizo",
        "--q",
        str(cfg.q),
        "--batch-size",
        str(cfg.batch_size),
        "--steps",
        str(STEPS),
        "--lr",
        LR,
        "--eps",
        EPS,
        "--rank",
        str(cfg.rank),
        "--alpha",
        str(cfg.alpha),
        "--seed",
        str(SEED),
        "--seq-len",
        str(cfg.seq_len),
        "--device",
        "cpu",
        *SCHEDULE,
        "--out",
        str(tmp_path / "train"),
    ]
    assert main(args) == 0
    ours = [json.loads(line) for line in (device_run / "train_log.jsonl").read_text().splitlines()]
    theirs = [json.loads(line) for line in (tmp_path / "train" / "train_log.jsonl").read_text().splitlines()]
    assert [r["seed"] for r in ours] == [r["seed"] for r in theirs]
    assert [r["lr"] for r in ours] == [r["lr"] for r in theirs] == lrs(float(LR), STEPS, "linear", 2, 0.1)
    # Same steps, same rows; padding width and kernels differ (XNNPACK vs ATen): each loss within the float32 forward
    # bound, plus what the two B's drift apart by (bounded from the measured g's; tests/utils/tolerance.py).
    theirs_g = [r["g"] for r in theirs]
    drift = b_drift([r["g"] for r in ours], theirs_g, float(LR))
    loss_atol = loss_rtol(AutoConfig.from_pretrained(tiny_model_dir)) * max(max(map(abs, r["losses"])) for r in theirs)
    size = sum(b.numel() for b in read_adapter(device_run / "adapter")[2].values())
    for k, (mine, train) in enumerate(zip(ours, theirs, strict=True)):
        atol = losses_atol_with_drift(loss_atol, theirs_g, drift[k], size)
        np.testing.assert_allclose(mine["losses"], train["losses"], rtol=0, atol=atol)


def test_evaluation_is_mobizo_evals(device_run: Path, sst2, tiny_model_dir: Path) -> None:
    from shared.adapter import load_adapter
    from shared.data import load_examples
    from shared.evaluate import evaluate
    from shared.hf_models import load_model
    from shared.tasks import get_task

    device_eval = json.loads((device_run / "metrics.json").read_text())["eval"][-1]
    model, tokenizer = load_model(tiny_model_dir)
    load_adapter(model, device_run / "adapter")
    reference = evaluate(
        model, tokenizer, get_task("sst2"), load_examples(get_task("sst2"), sst2[1]), max_len=TINY_Q4.seq_len
    )
    assert device_eval["accuracy"] == reference["accuracy"]
    assert device_eval["loss"] == pytest.approx(reference["loss"], rel=loss_rtol(model.config))  # XNNPACK vs ATen


@pytest.mark.parametrize(
    "edit, flag",
    [
        (lambda a, p: a + ["--steps", "0"], "--steps"),
        (lambda a, p: a + ["--lr", "-1"], "--lr"),
        (lambda a, p: a + ["--warmup-steps", "3", "--steps", "3"], "--warmup-steps"),
        (lambda a, p: a + ["--lr-floor", "2"], "--lr-floor"),
        (lambda a, p: a + ["--seed", "-3"], "--seed"),
        (lambda a, p: a + ["--train", str(p / "missing.jsonl")], "--train"),
        (lambda a, p: a + ["--store", str(p)], "--store"),
        (lambda a, p: [a[0], "--program", str(p / "x.pte"), *a[3:]], "--program"),
    ],
)
def test_bad_arguments_exit_2_naming_the_flag(program_factory, sst2, tmp_path: Path, capsys, edit, flag) -> None:
    pte, _ = program_factory(TINY_Q4)
    base = [
        "run-program",
        "--program",
        str(pte),
        "--task",
        "sst2",
        "--train",
        str(sst2[0]),
        "--steps",
        "1",
        "--lr",
        "0.1",
        "--eps",
        "0.01",
        "--out",
        str(tmp_path / "out"),
    ]
    assert main(edit(base, tmp_path)) == 2
    assert f"argument {flag}" in capsys.readouterr().err


def test_what_is_not_given_is_a_jobs_default_for_the_programs_objective_and_weights(program_factory) -> None:
    """The same flags as a device leased the job: a classification program with no lr, eps, steps or schedule runs
    a job's classification defaults (cosine, not constant); what is given is kept."""
    import argparse

    from device_agent.commands.run_program import with_job_defaults
    from shared import defaults

    pte, manifest = program_factory(TINY_Q4)
    bare = argparse.Namespace(steps=None, lr=None, lr_schedule=None, eps=None)
    with_job_defaults(bare, manifest)
    tuned = defaults.for_method(defaults.METHOD, "none", "classification")
    assert (bare.steps, bare.lr, bare.lr_schedule, bare.eps) == (tuned.steps, tuned.lr, tuned.lr_schedule, tuned.eps)
    assert bare.lr_schedule == "cosine"
    given = argparse.Namespace(steps=5, lr=0.5, lr_schedule="constant", eps=0.05)
    with_job_defaults(given, manifest)
    assert (given.steps, given.lr, given.lr_schedule, given.eps) == (5, 0.5, "constant", 0.05)
