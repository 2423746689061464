"""benchmarks/accuracy.py on the tiny model: samples, pilots, the continued winner, the table, and a run that is
killed and started again ending exactly where an uninterrupted run ends."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.accuracy import main, sample_task
from shared import defaults
from shared.data import read_jsonl
from shared.tasks import task_data_dir

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--tasks", "sst2", "--methods", "zero-shot,mobizo-q4", "--lr", "mobizo-q4=1e-2,1e-3", "--seq-len", "64"]
SMALL += ["--n-train", "32", "--n-val", "16", "--n-test", "16", "--pilot-steps", "4", "--eval-every", "2"]
SMALL += ["--batch-size", "4", "--threads", "1"]
STEPS = 40


def _args(model: Path, out: Path, *extra: str) -> list[str]:
    return ["--model", str(model), "--out", str(out), "--steps", str(STEPS), *SMALL, *extra]


def _without_times(results: dict) -> dict:
    """The results minus wall-clock figures, which differ between two runs of the same computation."""
    for rows in results["tasks"].values():
        for row in rows.values():
            for key in ("step_time_s", "train_time_s"):
                row.pop(key, None)
    return results


def test_boolq_is_sampled_from_its_validation_split_and_tested_on_the_rest(tmp_path: Path) -> None:
    """On the shipped sample's 300 BoolQ validation examples (the paper's 1,000 + 500 need the full 3,270)."""
    args = argparse.Namespace(n_train=100, n_val=50, n_test=5000, sample_seed=0)
    files = sample_task("boolq", task_data_dir(), tmp_path, args)
    splits = {name: read_jsonl(path) for name, path in files.items()}
    pool = read_jsonl(task_data_dir() / "superglue" / "boolq" / "validation.jsonl")
    assert [len(splits[s]) for s in ("train", "val", "test")] == [100, 50, len(pool) - 150]
    keys = {s: {json.dumps(r, sort_keys=True) for r in splits[s]} for s in splits}
    assert not (keys["train"] & keys["val"] or keys["train"] & keys["test"] or keys["val"] & keys["test"])
    assert keys["train"] | keys["val"] | keys["test"] == {json.dumps(r, sort_keys=True) for r in pool}
    again = sample_task("boolq", task_data_dir(), tmp_path / "again", args)
    assert all(files[s].read_bytes() == again[s].read_bytes() for s in files)  # seeded


def _kill_mid_run(model: Path, out: Path) -> None:
    """Start the benchmark in a process and SIGKILL it once its main run has checkpointed past the pilot."""
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "accuracy.py"), *_args(model, out, "--no-plot")]
    process = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state = out / "runs" / "sst2" / "mobizo-q4" / "main" / "checkpoint" / "state.json"
    try:
        while process.poll() is None:
            try:  # checkpoints are replaced whole: a reader sees the old one, the new one, or (between) none
                if json.loads(state.read_text())["step"] > 4:
                    process.send_signal(signal.SIGKILL)
                    break
            except FileNotFoundError:
                pass
            time.sleep(0.01)
        process.wait(timeout=600)
    finally:
        process.kill()
    assert process.returncode == -signal.SIGKILL, "the benchmark finished before it could be killed"
    assert not (out / "results.json").exists()


def test_a_killed_run_resumes_to_the_same_results(tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    assert main(_args(tiny_model_dir, tmp_path / "whole")) == 0
    table = capsys.readouterr().out
    whole = json.loads((tmp_path / "whole" / "results.json").read_text())
    assert (tmp_path / "whole" / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    row = whole["tasks"]["sst2"]["mobizo-q4"]
    # the pilot with the lowest final validation loss wins, and the main run is that pilot continued
    pilots = {p["lr"]: p for p in row["pilots"]}
    assert row["lr"] == min(pilots, key=lambda lr: pilots[lr]["eval"][-1]["loss"])
    assert row["curve"][: len(pilots[row["lr"]]["eval"])] == pilots[row["lr"]]["eval"]
    assert [e["step"] for e in row["curve"]] == list(range(0, STEPS + 1, 2))
    best = max(row["curve"], key=lambda e: e["accuracy"])
    assert (row["best_step"], row["val_accuracy"]) == (best["step"], best["accuracy"])
    assert row["test"]["n"] == 16 and f"{row['test']['accuracy']:.3f}" in table.splitlines()[-1]

    _kill_mid_run(tiny_model_dir, tmp_path / "resumed")
    assert main(_args(tiny_model_dir, tmp_path / "resumed")) == 0
    resumed = json.loads((tmp_path / "resumed" / "results.json").read_text())
    assert _without_times(resumed) == _without_times(whole)


def test_the_objective_flag_reaches_each_run(tmp_path: Path) -> None:
    """--objective lm trains the whole-vocabulary loss (the published lm rows); without it a run takes the task's."""
    from benchmarks.accuracy import METHODS, parse_args, run_config

    files = {split: tmp_path / f"{split}.jsonl" for split in ("train", "val", "test")}
    for extra, objective in ((["--objective", "lm"], "lm"), ([], None)):
        args = parse_args(["--model", "m", "--out", str(tmp_path), *extra])
        assert run_config(args, "sst2", files, METHODS["mobizo-q4"], 1e-2, tmp_path, 10).objective == objective


def seed_program(model_dir: Path, config, pte: Path, manifest, out: Path) -> Path:
    """Put the suite's exported ``pte`` (of ``config``) where the benchmark run in ``out`` finds it exported, as a
    run that exported it before would → its entry folder."""
    import shutil

    from benchmarks.accuracy import program_entry
    from shared.manifest import manifest_path

    entry = program_entry(model_dir, config, out / "programs")
    entry.mkdir(parents=True)
    shutil.copyfile(pte, entry / "program.pte")
    manifest_path(entry / "program.pte").write_bytes(manifest.to_json())
    for name in (manifest.ptd.file, manifest.tokenizer.file):
        shutil.copyfile(pte.parent / name, entry / name)
    return entry


def test_the_program_runner_trains_through_the_devices_program(
    tiny_model_dir: Path, program_factory, tmp_path: Path, monkeypatch
) -> None:
    """``--runner program``: every step is the exported program's, on the batches a device builds from the same
    data (``device_agent.local_data.step_batches``): the run's losses and g are the program's on those batches, bit
    for bit; its log replays to its B; a run stopped after a checkpoint resumes to the very same B.

    The program is the suite's ``TINY_Q4`` (the run's config, resolved as a device program): the benchmark finds it
    exported in its folder, as a run that exported it before would."""

    import numpy as np
    import torch
    from transformers import AutoTokenizer

    import device_agent.et_program as et_program
    from benchmarks.accuracy import program_entry
    from benchmarks.program_steps import ProgramStep
    from device_agent.local_data import program_shape, step_batches
    from shared.checkpoint import load_checkpoint
    from shared.data import load_examples
    from shared.replay import replay
    from shared.tasks import get_task
    from shared.train_log import read_log
    from tests.utils.programs import TINY_Q4

    pte, manifest = program_factory(TINY_Q4)
    steps, lr = 12, 0.5
    args = ["--model", str(tiny_model_dir), "--runner", "program", "--tasks", "sst2", "--methods"]
    args += ["zero-shot,mobizo-q4", "--lr", f"mobizo-q4={lr}", "--seq-len", "16", "--rank", "4", "--alpha", "8"]
    args += ["--batch-size", "8", "--n-train", "32", "--n-val", "16", "--n-test", "16", "--eval-every", "4"]
    args += ["--steps", str(steps), "--threads", "1", "--no-plot"]

    def seeded(out: Path) -> Path:
        seed_program(tiny_model_dir, TINY_Q4, pte, manifest, out)
        return out

    out = seeded(tmp_path / "whole")
    assert main([*args, "--out", str(out)]) == 0
    assert [p.name for p in (out / "programs").iterdir()] == [program_entry(tiny_model_dir, TINY_Q4, out).name]
    results = json.loads((out / "results.json").read_text())
    assert results["runner"] == "program"
    row = results["tasks"]["sst2"]["mobizo-q4"]
    assert row["steps"] == steps and [e["step"] for e in row["curve"]] == [0, 4, 8, 12]
    run = out / "runs" / "sst2" / "mobizo-q4-program" / "main"
    log, final = read_log(run / "train_log.jsonl"), load_checkpoint(run)
    assert final.step == steps and final.b.abs().max() > 0
    assert torch.equal(replay(torch.zeros_like(final.b), log), final.b)

    # the device's batches of the same data, through the same program: the very losses and g of the run's log
    task = get_task("sst2")
    examples = load_examples(task, out / "data" / "sst2" / "train.jsonl")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    session = et_program.ProgramSession(pte, pte.parent / manifest.ptd.file, evaluate=False)
    session.set_b(np.zeros(manifest.lora_size, np.float32))
    eps = np.float32(log[0]["eps"])
    schedule = results["lr_schedule"]["shape"]  # the objective's default, as a job's
    shape = program_shape(TINY_Q4)
    batches = step_batches(examples, tokenizer, shape, defaults.SEED, steps, lr, schedule, bucket=defaults.BUCKET)
    for record, batch in zip(log, batches, strict=True):
        losses, g = session.step(batch, batch.lr, float(eps))
        assert (batch.seed, np.float32(batch.lr)) == (record["seed"], np.float32(record["lr"]))
        assert np.array_equal(losses, np.float32(record["losses"])) and np.array_equal(g, np.float32(record["g"]))
    assert np.array_equal(session.get_b(), final.b.numpy())

    # stopped at step 6 (its checkpoint is step 4's), then run again: the same B, bit for bit
    calls, step = [], ProgramStep.__call__

    def stopping(self, batch, seed, lr):
        calls.append(seed)
        if len(calls) == 7:
            raise KeyboardInterrupt("stopped mid-run")
        return step(self, batch, seed, lr)

    resumed = seeded(tmp_path / "resumed")
    monkeypatch.setattr(ProgramStep, "__call__", stopping)
    with pytest.raises(KeyboardInterrupt):
        main([*args, "--out", str(resumed)])
    monkeypatch.setattr(ProgramStep, "__call__", step)
    assert main([*args, "--out", str(resumed)]) == 0
    again = load_checkpoint(resumed / "runs" / "sst2" / "mobizo-q4-program" / "main")
    assert torch.equal(again.b, final.b)
    assert _without_times(json.loads((resumed / "results.json").read_text())) == _without_times(results)


def test_quantize_trains_through_the_8da4w_program_at_its_eps(tiny_model_dir: Path, program_factory, tmp_path: Path):
    """``--quantize 8da4w``: the run's steps are the 8da4w program's (the suite's ``TINY_Q4_8DA4W``, found exported
    in the benchmark's folder), at a job's eps for it; its log replays to its B. A quantized eager run is refused,
    naming the flag."""

    import numpy as np
    import torch

    from shared.checkpoint import load_checkpoint
    from shared.replay import replay
    from shared.train_log import read_log
    from tests.utils.programs import TINY_Q4_8DA4W

    args = ["--model", str(tiny_model_dir), "--tasks", "sst2", "--methods", "zero-shot,mobizo-q4", "--quantize"]
    args += ["8da4w", "--lr", "mobizo-q4=0.5", "--seq-len", "16", "--rank", "4", "--alpha", "8", "--batch-size", "8"]
    args += ["--n-train", "32", "--n-val", "16", "--n-test", "16", "--eval-every", "2", "--steps", "2", "--no-plot"]
    with pytest.raises(SystemExit, match="--quantize 8da4w"):
        main([*args, "--out", str(tmp_path / "eager")])

    pte, manifest = program_factory(TINY_Q4_8DA4W)
    out = tmp_path / "program"
    entry = seed_program(tiny_model_dir, TINY_Q4_8DA4W, pte, manifest, out)
    assert main([*args, "--runner", "program", "--threads", "1", "--out", str(out)]) == 0
    assert [p.name for p in (out / "programs").iterdir()] == [entry.name]  # nothing else was exported
    assert json.loads((out / "results.json").read_text())["quantize"] == "8da4w"
    run = out / "runs" / "sst2" / "mobizo-q4-program-8da4w" / "main"
    log, final = read_log(run / "train_log.jsonl"), load_checkpoint(run)
    eps = float(np.float32(defaults.QUANTIZED_EPS["8da4w"]))  # the program's float32 eps, as logged
    assert [r["eps"] for r in log] == [eps] * 2 and final.b.abs().max() > 0
    assert torch.equal(replay(torch.zeros_like(final.b), log), final.b)


def test_optimizers_make_a_row_each_and_the_steps_to_sgds_accuracy_are_read_off_the_curves(tmp_path: Path) -> None:
    from benchmarks.accuracy import method_of, parse_args, reach_table, run_config, with_optimizers

    rows = with_optimizers(["zero-shot", "mobizo-q4", "fo-lora"], ["sgd", "momentum"])
    assert rows == ["zero-shot", "mobizo-q4", "mobizo-q4+momentum", "fo-lora"]
    files = {split: tmp_path / f"{split}.jsonl" for split in ("train", "val", "test")}
    args = parse_args(["--model", "m", "--out", str(tmp_path)])
    config = run_config(args, "sst2", files, method_of("mobizo-q4+momentum"), 1e-2, tmp_path, 10)
    assert (config.optimizer, config.q) == ("momentum", 4)

    def curve(*accuracies: float) -> list[dict]:
        return [{"step": 50 * k, "accuracy": a} for k, a in enumerate(accuracies)]

    results = {"tasks": {"sst2": {
        "mobizo-q4": {"steps": 200, "curve": curve(0.5, 0.6, 0.65, 0.7, 0.72)},
        "mobizo-q4+momentum": {"steps": 200, "curve": curve(0.5, 0.73, 0.75, 0.74, 0.76)},
    }}}  # fmt: skip
    lines = reach_table(results).splitlines()
    assert "reaches 0.720 at step   200  (1.00x" in lines[0] and "at step    50  (4.00x" in lines[1]
