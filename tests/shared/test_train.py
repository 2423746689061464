"""Training end to end: ``train()`` and ``mobizo train`` on the tiny model and real SST-2 data.

The unit-level invariants (schedules agree, MeZO-LoRA = MobiZO q=1) are in test_zo.py; here they are checked again
through the whole loop: data order, step seeds, batches padded per step, adapter and log files.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoConfig

from mobizo.cli import main
from shared import defaults
from shared.adapter import read_adapter
from shared.lora import layout_order
from shared.replay import replay
from shared.schedule import lr_at
from shared.tasks import task_data_dir
from shared.train import ADAPTER_DIR, LOG_FILE, METRICS_FILE, TrainConfig, train
from shared.train_log import read_log
from tests.utils.tolerance import Z_MAX, loss_rtol, step_atols

pytestmark = pytest.mark.numerics  # CI runs these again on ATen's portable kernels (.ci/run)

SST2 = task_data_dir() / "sst2"
TRAIN, HELD_OUT = SST2 / "train.jsonl", SST2 / "validation.jsonl"
REQUIRED_METRICS = {  # docs/contracts.md, "Command line"
    "method",
    "q",
    "batch_size",
    "steps",
    "lr",
    "eps",
    "seed",
    "losses",
    "step_time_s",
    "peak_rss_mb",
    "eval",
}


def _config(model_dir: Path, out: Path, **changes) -> TrainConfig:
    return TrainConfig(
        **{"model": model_dir, "task": "sst2", "train": TRAIN, "out": out, "device": "cpu", "limit_train": 64} | changes
    )


def adapter_flat_b(out: Path) -> torch.Tensor:
    """The adapter's B as the flat vector (modules in layout order), as training and replay hold it."""
    _, _, lora_b = read_adapter(out / ADAPTER_DIR)
    return torch.cat([lora_b[name].reshape(-1) for name in layout_order(lora_b)])


# Learning rates from a sweep on this setup (tiny model, 400 SST-2 examples, batch 16, 100 steps, objective lm): mobizo
# q=2 with lr in {1e-3, 3e-3, 1e-2, 2e-2, 3e-2} lowered the held-out loss by at most 0.21, lr 1e-2 by 0.13-0.21 over
# run seeds 0-3; fo-lora with lr 0.1 by 0.56. The margins leave room for other CPUs' rounding. The tiny random model
# knows no sentiment, so the classification objective's gain is shown on SmolLM2 (tests/shared/test_real_model.py).
@pytest.mark.parametrize(
    ("method", "q", "lr", "steps", "margin"), [("mobizo", 2, 1e-2, 100, 0.08), ("fo-lora", 1, 0.1, 60, 0.25)]
)
def test_short_seeded_run_lowers_held_out_loss(tiny_model_dir, tmp_path, method, q, lr, steps, margin):
    config = _config(
        tiny_model_dir,
        tmp_path,
        method=method,
        q=q,
        lr=lr,
        steps=steps,
        batch_size=16,
        limit_train=400,
        eval=HELD_OUT,
        limit_eval=100,
        objective="lm",
    )
    metrics = train(config, progress=False)
    before, after = metrics["eval"][0], metrics["eval"][-1]
    assert (before["step"], after["step"]) == (0, steps)
    assert after["loss"] < before["loss"] - margin, (before, after)


SHORT = {"steps": 3, "batch_size": 8, "lr": 5e-2, "eps": 1e-2}


def _short_run(model_dir: Path, out: Path, **changes) -> tuple[dict, torch.Tensor]:
    metrics = train(_config(model_dir, out, **SHORT | changes), progress=False)
    return metrics, adapter_flat_b(out)


def _float64_bounds(model_dir: Path, losses: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(loss, B) tolerances of a float64 run whose losses and B were written as float32.

    The float64 bound of each step (tests/utils/tolerance.py) plus one float32 rounding of the largest value written:
    the files hold float32, so two runs equal in float64 to 1e-12 may still differ by one float32 ulp there.
    """
    loss_atol, _, b_atol = step_atols(
        AutoConfig.from_pretrained(model_dir), torch.float64, float(losses.abs().max()), SHORT["eps"], SHORT["lr"]
    )
    f32 = 2.0**-24
    return loss_atol + float(losses.abs().max()) * f32, SHORT["steps"] * b_atol + float(b.abs().max()) * f32


def test_parallel_schedules_give_the_same_losses_and_b(tiny_model_dir, tmp_path):
    """q=4, E=2 on real sentences: ``inner``/``none`` run each query with its own (smaller) padding.

    In float64, where other padding widths and other CPU kernels cannot hide behind rounding: the float32 loss
    differences, magnified by 1/(2 eps) in g, would not be an identity check (see tests/utils/tolerance.py).
    """
    _, ref_b = _short_run(tiny_model_dir, tmp_path / "both", q=4, parallel="both", dtype="float64")
    ref_losses = torch.tensor([r["losses"] for r in read_log(tmp_path / "both" / LOG_FILE)])
    assert ref_b.abs().max() > 0
    loss_atol, b_atol = _float64_bounds(tiny_model_dir, ref_losses, ref_b)
    for mode in ("outer", "inner", "none"):
        _, b = _short_run(tiny_model_dir, tmp_path / mode, q=4, parallel=mode, dtype="float64")
        losses = torch.tensor([r["losses"] for r in read_log(tmp_path / mode / LOG_FILE)])
        torch.testing.assert_close(losses, ref_losses, rtol=0, atol=loss_atol, msg=mode)
        torch.testing.assert_close(b, ref_b, rtol=0, atol=b_atol, msg=mode)


def test_mezo_lora_matches_mobizo_with_one_query(tiny_model_dir, tmp_path):
    mezo, b_mezo = _short_run(tiny_model_dir, tmp_path / "mezo-lora", method="mezo-lora", dtype="float64")
    mobizo, b_mobizo = _short_run(tiny_model_dir, tmp_path / "mobizo", method="mobizo", q=1, dtype="float64")
    losses = torch.tensor(mobizo["losses"])
    loss_atol, b_atol = _float64_bounds(tiny_model_dir, losses, b_mobizo)
    torch.testing.assert_close(torch.tensor(mezo["losses"]), losses, rtol=0, atol=loss_atol)
    # MeZO's in-place walk (+eps, -2 eps, +eps) does not restore B bit for bit: 4 more float64 roundings per step.
    walk = 4 * SHORT["steps"] * float(b_mobizo.abs().max() + SHORT["eps"] * Z_MAX) * 2.0**-53
    torch.testing.assert_close(b_mezo, b_mobizo, rtol=0, atol=b_atol + walk)
    assert mezo["train_log"] is None and not (tmp_path / "mezo-lora" / LOG_FILE).exists()


def test_mezo_full_writes_metrics_only(tiny_model_dir, tmp_path):
    (tmp_path / ADAPTER_DIR).mkdir()  # an earlier run's outputs in the same folder must not pass for this run's
    (tmp_path / LOG_FILE).write_text("{}\n")
    metrics = train(_config(tiny_model_dir, tmp_path, method="mezo", steps=2, batch_size=4, lr=1e-5), progress=False)
    assert metrics["adapter"] is None and "no adapter" in metrics["note"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [METRICS_FILE]
    assert len(metrics["losses"]) == 2 and all(math.isfinite(x) for x in metrics["losses"])


def _cli(model_dir: Path, out: Path, *extra: str) -> int:
    return main(
        [
            "train",
            "--model",
            str(model_dir),
            "--task",
            "sst2",
            "--train",
            str(TRAIN),
            "--out",
            str(out),
            "--device",
            "cpu",
            "--limit-train",
            "64",
            *extra,
        ]
    )


def test_cli_writes_adapter_metrics_and_a_replayable_log(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    args = (
        "--eval",
        str(HELD_OUT),
        "--limit-eval",
        "20",
        "--q",
        "2",
        "--batch-size",
        "4",
        "--steps",
        "3",
        "--lr",
        "1e-2",
        "--lr-schedule",
        "cosine",
        "--lr-floor",
        "0.1",
    )
    assert _cli(tiny_model_dir, out, *args) == 0
    assert "wrote adapter/, train_log.jsonl, metrics.json" in capsys.readouterr().out
    metrics = json.loads((out / METRICS_FILE).read_text())
    assert REQUIRED_METRICS <= metrics.keys()
    assert (metrics["method"], metrics["q"], metrics["batch_size"], metrics["parallel"]) == ("mobizo", 2, 4, "both")
    assert len(metrics["losses"]) == 3 and all(math.isfinite(x) for x in metrics["losses"])
    assert [e["step"] for e in metrics["eval"]] == [0, 3] and metrics["step_time_s"] > 0
    config, _, _ = read_adapter(out / ADAPTER_DIR)
    rank = defaults.for_method("mobizo", objective="classification").rank  # SST-2's objective's default, alpha 2x
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (
        rank,
        2.0 * rank,
        ["q_proj", "v_proj"],
    )
    log = read_log(out / LOG_FILE)
    assert [(r["step"], len(r["g"]), len(r["losses"])) for r in log] == [(0, 2, 4), (1, 2, 4), (2, 2, 4)]
    # Each step ran (and logged) the schedule's float32 lr: 1e-2, then cosine decay towards 1e-3.
    assert (metrics["lr_schedule"], metrics["warmup_steps"], metrics["lr_floor"]) == ("cosine", 0, 0.1)
    assert [r["lr"] for r in log] == [lr_at(1e-2, 3, k, "cosine", 0, 0.1) for k in range(3)]
    assert log[0]["lr"] == float(np.float32(1e-2)) > log[1]["lr"] > log[2]["lr"] > float(np.float32(1e-3))
    b = adapter_flat_b(out)
    assert b.abs().max() > 0 and torch.equal(replay(torch.zeros_like(b), log), b)  # the log rebuilds B exactly


def test_trained_adapter_evaluates_as_during_training(tiny_model_dir, tmp_path, capsys):
    """``mobizo eval --adapter`` on the written adapter (A and B) reproduces the final in-training evaluation."""
    out = tmp_path / "run"
    assert (
        _cli(
            tiny_model_dir,
            out,
            "--eval",
            str(HELD_OUT),
            "--limit-eval",
            "20",
            "--steps",
            "2",
            "--lr",
            "0.05",
            "--method",
            "fo-lora",
            "--batch-size",
            "4",
        )
        == 0
    )
    final = json.loads((out / METRICS_FILE).read_text())["eval"][-1]
    capsys.readouterr()
    assert (
        main(
            [
                "eval",
                "--model",
                str(tiny_model_dir),
                "--adapter",
                str(out / ADAPTER_DIR),
                "--task",
                "sst2",
                "--data",
                str(HELD_OUT),
                "--limit",
                "20",
                "--device",
                "cpu",
                "--json",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["loss"] == pytest.approx(final["loss"], rel=loss_rtol(AutoConfig.from_pretrained(tiny_model_dir)))
    assert result["accuracy"] == final["accuracy"]


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (("--q", "3", "--batch-size", "4"), "--q"),
        (("--method", "mezo-lora", "--q", "2", "--batch-size", "4"), "--q"),
        (("--method", "fo-lora", "--q", "2", "--batch-size", "4"), "--q"),
        (("--method", "adam"), "--method"),
        (("--parallel", "sideways"), "--parallel"),
        (("--lr", "-0.001"), "--lr"),
        (("--eps", "0"), "--eps"),
        (("--steps", "0"), "--steps"),
        (("--steps", "5", "--warmup-steps", "5"), "--warmup-steps"),
        (("--lr-floor", "1.5"), "--lr-floor"),
        (("--eval", "/nonexistent/validation.jsonl"), "--eval"),
        (("--eval-every", "2"), "--eval-every"),
        (("--dtype", "float8"), "--dtype"),
        (("--task", "imdb"), "--task"),
        (("--dp-epsilon", "0"), "--dp-epsilon"),
        (("--dp-epsilon", "8", "--dp-clip", "-1"), "--dp-clip"),
        (("--dp-epsilon", "8", "--dp-delta", "1"), "--dp-delta"),
        (("--dp-epsilon", "8", "--method", "fo-lora", "--q", "1"), "--dp-epsilon"),
    ],
)
def test_bad_arguments_exit_2_naming_the_argument(tiny_model_dir, tmp_path, capsys, extra, flag):
    out = tmp_path / "run"
    assert _cli(tiny_model_dir, out, *extra) == 2
    assert f"argument {flag}:" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("flag", ["--model", "--train"])
def test_missing_model_or_data_exits_2(tiny_model_dir, tmp_path, capsys, flag):
    args = ["train", "--model", str(tiny_model_dir), "--task", "sst2", "--train", str(TRAIN), "--out", str(tmp_path)]
    args[args.index(flag) + 1] = str(tmp_path / "missing")
    assert main(args) == 2
    assert f"argument {flag}:" in capsys.readouterr().err


def test_step_time_benchmark_times_every_method(tiny_model_dir, tmp_path, capsys):
    """benchmarks/step_time.py runs the training loop's steps; it must keep working as they change."""
    from benchmarks.step_time import main as benchmark

    out = tmp_path / "bench.json"
    args = [
        "--model",
        str(tiny_model_dir),
        "--device",
        "cpu",
        "--q",
        "2",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--json-out",
        str(out),
    ]
    assert benchmark(args) == 0
    results = json.loads(out.read_text())["results"]
    labels = ["mezo", "mezo-lora", "mobizo-both", "mobizo-outer", "mobizo-inner", "mobizo-none", "fo-lora"]
    assert list(results) == [*labels, "inference"] and results["mezo-lora"]["time_ratio"] == 1.0
    assert all(len(r["times_s"]) == 2 and r["median_s"] > 0 for r in results.values())
    if results["inference"]["peak_mb"] is not None:  # Linux: memory measured, ratios to inference given
        assert results["inference"]["peak_mb_vs_inference"] == 1.0
    out = capsys.readouterr().out
    assert "| mobizo-both |" in out and "| inference |" in out


def test_runs_without_lr_eps_steps_use_their_method_defaults(tiny_model_dir, tmp_path, capsys):
    """The defaults live in shared.defaults, per method; `mobizo train` and `mobizo jobs submit` both read them."""
    from shared.schemas import JobCreate

    for method in ("mobizo", "fo-lora"):  # SST-2's answers are single tokens: the classification objective's
        chosen = defaults.for_method(method, objective="classification")
        config = _config(tiny_model_dir, tmp_path / method, method=method, steps=1, batch_size=4)
        metrics = train(config, progress=False)
        assert (metrics["lr"], metrics["eps"], metrics["steps"]) == (chosen.lr, chosen.eps, 1)
        assert (metrics["rank"], metrics["alpha"], metrics["lr_schedule"]) == (
            chosen.rank,
            2 * chosen.rank,
            chosen.lr_schedule,
        )
    job, chosen = JobCreate(model="m", task="sst2"), defaults.for_method("mobizo", objective="classification")
    assert job.objective == "classification" and JobCreate(model="m", task="lm", answer_len=4).objective == "lm"
    lm = JobCreate(model="m", task="sst2", objective="lm")
    assert (
        (lm.lr, lm.steps)
        == (defaults.for_method("mobizo").lr, defaults.for_method("mobizo").steps)
        != (job.lr, job.steps)
    )
    assert (job.lr, job.eps, job.steps) == (chosen.lr, chosen.eps, chosen.steps)
    assert (job.rank, job.alpha, job.lr_schedule) == (chosen.rank, 2 * chosen.rank, chosen.lr_schedule)
    assert (lm.rank, lm.alpha, lm.lr_schedule) == (defaults.RANK, defaults.ALPHA, defaults.LR_SCHEDULE)
    assert {"rank", "alpha", "lr_schedule"} <= job.defaulted
    given = JobCreate(model="m", task="sst2", rank=8, lr_schedule="linear")  # alpha follows a given rank
    assert (given.rank, given.alpha, given.lr_schedule) == (8, 16.0, "linear") and "rank" not in given.defaulted
    assert JobCreate(model="m", task="sst2", rank=8, alpha=4).alpha == 4.0
    assert defaults.for_method("mezo").lr != defaults.for_method("mobizo").lr  # per method, not one value
    quantized = JobCreate(model="m", task="sst2", quantize="8da4w")  # its g needs a larger eps (shared.defaults)
    assert (quantized.lr, quantized.eps) == (chosen.lr, defaults.QUANTIZED_EPS["8da4w"]) != (job.lr, job.eps)
    assert JobCreate(model="m", task="sst2", quantize="8da4w", eps=0.02).eps == 0.02  # a given eps is kept
    private = JobCreate(model="m", task="sst2", privacy={"epsilon": 8, "min_examples": 100})  # the method's own lr
    assert (private.lr, private.privacy.clip, private.privacy.delta) == (job.lr, defaults.DP_CLIP, defaults.DP_DELTA)
    for command in (["train"], ["jobs", "submit"]):
        with pytest.raises(SystemExit):
            main([*command, "--help"])
        assert "benchmarks/accuracy.py" in " ".join(capsys.readouterr().out.split())


def test_a_runs_device_program_is_resolved_from_its_config(tmp_path: Path) -> None:
    """``program_config``: the program that takes a run's step (``--runner program``), built by the one rule for a
    job's program (``ProgramConfig.from_spec``); mezo-lora is the one-query program with its paths one after the
    other, and so is fo-lora's config; what has no program (mezo) is refused naming the field."""
    from dataclasses import replace

    from shared.errors import UsageError
    from shared.train import program_config
    from tests.utils.programs import TINY_Q4

    run = TrainConfig(tmp_path, "sst2", tmp_path, tmp_path, q=4, batch_size=8, seq_len=16, rank=4, alpha=8.0)
    assert program_config(run, "classification", (392, 373), 1) == TINY_Q4
    mezo = program_config(replace(run, method="mezo-lora", q=1), "lm", (), 2)
    assert (mezo.q, mezo.parallel, mezo.objective, mezo.answer_len) == (1, "none", "lm", 2)
    # fo-lora's (shared.fo_program): the batch's rows once, the same adapter and objective
    first_order = program_config(replace(run, method="fo-lora", q=1), "classification", (392, 373), 1)
    assert first_order == TINY_Q4.model_copy(update={"q": 1, "parallel": "none"})
    for change, field in (({"method": "mezo", "q": 1}, "method"), ({"seq_len": None}, "seq_len")):
        with pytest.raises(UsageError) as refused:
            program_config(replace(run, **change), "classification", (392, 373), 1)
        assert refused.value.field == field
    with pytest.raises(UsageError, match="answer-len"):
        program_config(run, "lm", (), None)


def test_each_order_of_step_reports_its_own_quantities(tiny_model_dir) -> None:
    """The loop's ``Step`` of each order: a zeroth-order step returns its path losses and g [q] (the log's), the
    first-order step its loss and the norm of the gradient that moved B, named so; both move B."""
    from shared.baselines import fo_lora_loss_and_grad
    from shared.hf_models import load_model
    from shared.lora import inject_lora
    from shared.train import FirstOrderOut, MethodStep, ZerothOrderOut
    from tests.utils.tiny import random_batch

    model, _ = load_model(tiny_model_dir, "float32")
    lora = inject_lora(model, defaults.TARGETS, 4, 8.0, 0)
    batch = random_batch(4, seed=0, max_len=12, vocab=model.config.vocab_size)
    zeroth = MethodStep("mobizo", model, lora, q=2, lr=1e-2, eps=1e-2)
    out = zeroth(batch, seed=3)
    assert type(out) is ZerothOrderOut and out.losses.shape == (4,) and out.g.shape == (2,)
    assert zeroth.b.abs().max() > 0
    first = MethodStep("fo-lora", model, lora, lr=0.1)
    start = first.b.clone()
    _, grad = fo_lora_loss_and_grad(model, lora, batch, start)
    out = first(batch, seed=3)
    assert type(out) is FirstOrderOut and out.losses.shape == (1,) and not hasattr(out, "g")
    torch.testing.assert_close(out.grad_norm, grad.norm().reshape(1))  # the same autograd, the same rows
    torch.testing.assert_close(first.b, start - 0.1 * grad)
