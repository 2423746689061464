"""Contextual calibration (``shared.calibration``): the content-free inputs, the prior's arithmetic, and the
calibrated prediction that ``mobizo eval --calibrate`` and a run's evaluation make."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from mobizo.cli import main
from shared.calibration import CONTENT_FREE, calibrated, content_free, prior_of
from shared.data import load_examples
from shared.tasks import get_task, task_data_dir


def test_content_free_inputs_fill_every_field_of_the_prompt() -> None:
    task = get_task("rte", "{premise} / {hypothesis}?", {"0": " yes", "1": " no"})
    assert [r.prompt for r in content_free(task)] == [f"{t} / {t}?" for t in CONTENT_FREE]
    wsc = content_free(get_task("wsc"))  # dotted fields reach inside
    assert all(r.candidates == ["No", "Yes"] for r in wsc) and "[MASK]" in wsc[2].prompt


def test_the_prior_is_the_log_of_the_mean_answer_probability() -> None:
    rows = [[-1.0, -3.0, -2.0], [-5.0, -0.5, -4.0], [-2.0, -2.0, -2.0]]
    prior = prior_of(rows)
    probs = np.exp(np.array(rows)) / np.exp(np.array(rows)).sum(axis=1, keepdims=True)
    assert prior == tuple(float(np.float32(math.log(p))) for p in probs.mean(axis=0))
    # float32 values: the sum of the probabilities is 1 within the rounding of three float32 logs
    assert abs(sum(math.exp(p) for p in prior) - 1) <= 3 * 2**-24 * 4
    one = [-0.25, -4.0]  # a single content-free input: calibrated, its own answers tie (to float32 rounding)
    flat = calibrated(one, prior_of([one]))
    assert abs(flat[0] - flat[1]) <= 2 * 2**-24 * max(map(abs, one + flat))
    assert calibrated(one, None) == one


def test_eval_calibrate_predicts_the_best_score_over_the_prior(tiny_model_dir: Path, capsys) -> None:
    """``mobizo eval --calibrate`` reports the prior it measured, and its accuracy is the share of examples whose
    best calibrated score (computed here from the uncalibrated scores) is the label's."""
    from shared.evaluate import candidate_scores
    from shared.hf_models import load_model

    data = task_data_dir() / "sst2" / "train.jsonl"
    argv = ["eval", "--model", str(tiny_model_dir), "--task", "sst2", "--data", str(data), "--limit", "40", "--json"]
    assert main([*argv, "--calibrate"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    model, tokenizer = load_model(tiny_model_dir)
    task = get_task("sst2")
    rendered = load_examples(task, data, 40)
    prior = prior_of(candidate_scores(model, tokenizer, content_free(task)))
    assert metrics["prior"] == list(prior)
    rows = [calibrated(r, prior) for r in candidate_scores(model, tokenizer, rendered)]
    hits = [max(range(2), key=row.__getitem__) == r.label for row, r in zip(rows, rendered, strict=True)]
    assert metrics["accuracy"] == sum(hits) / len(hits)
    assert main([*argv[:-1], "--task", "lm", "--calibrate"]) == 2  # classification only, naming the flag
    assert "--calibrate" in capsys.readouterr().err


@pytest.mark.parametrize("text", CONTENT_FREE)
def test_every_content_free_text_is_a_record_the_task_renders(text: str) -> None:
    task = get_task("boolq")
    assert any(text in r.prompt for r in content_free(task)) or text == ""


def test_a_calibrated_run_evaluates_as_eval_calibrate_does(tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    """``mobizo train --calibrate``: the prior in metrics.json and the accuracy before the first step are those of
    ``mobizo eval --calibrate`` on the same rows."""
    data = task_data_dir() / "sst2" / "train.jsonl"
    argv = ["--model", str(tiny_model_dir), "--task", "sst2"]
    assert main(["eval", *argv, "--data", str(data), "--limit", "24", "--calibrate", "--json"]) == 0
    scored = json.loads(capsys.readouterr().out)
    out = tmp_path / "run"
    train = [*argv, "--train", str(data), "--eval", str(data), "--limit-eval", "24", "--out", str(out)]
    assert main(["train", *train, "--steps", "1", "--batch-size", "4", "--q", "2", "--calibrate", "--json"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["prior"] == scored["prior"] and metrics["calibrate"] is True
    assert metrics["eval"][0]["accuracy"] == scored["accuracy"]


def test_a_devices_held_out_accuracy_divides_the_programs_prior_out(tiny_model_dir: Path) -> None:
    """``evaluate_program`` with a calibrated program's prior predicts and scores each row from its program scores
    minus the prior, exactly as ``shared.evaluate`` does from its own (the scores here are a stand-in program's,
    chosen so that the prior turns some predictions)."""
    from transformers import AutoTokenizer

    from device_agent.batches import Shape
    from device_agent.evaluation import evaluate_program
    from shared.evaluate import candidate_loss

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rendered = load_examples(get_task("sst2"), task_data_dir() / "sst2" / "train.jsonl", limit=12)
    rng = np.random.default_rng(0)
    table = rng.normal(size=(12, 2)).astype(np.float32) - np.float32([0, 1])  # leaning towards the first answer

    class Program:
        row = 0

        def evaluate(self, input_ids, attention_mask, targets):
            out = table[self.row : self.row + len(input_ids)]
            self.row += len(input_ids)
            return out

    prior = (-0.125, -1.0)
    shape = Shape(rows=12, seq_len=64, answer_len=1)
    got = evaluate_program(Program(), rendered, tokenizer, shape, "classification", (392, 373), prior)
    rows = [[float(a) - prior[0], float(b) - prior[1]] for a, b in table]
    hits = [max(range(2), key=row.__getitem__) == r.label for row, r in zip(rows, rendered, strict=True)]
    loss = sum(candidate_loss(row, r.label) for row, r in zip(rows, rendered, strict=True)) / 12
    assert got == {"accuracy": sum(hits) / 12, "loss": loss, "n": 12}
    plain = evaluate_program(Program(), rendered, tokenizer, shape, "classification", (392, 373))
    assert plain["loss"] != got["loss"]


def test_a_calibrated_jobs_program_holds_the_prior_of_its_prompt_on_the_base_model(tiny_model_dir: Path) -> None:
    """The server resolves a job with ``calibrate`` to a program config holding the prior ``mobizo eval
    --calibrate`` measures for the same prompt; without it, the config has none (and its JSON no key)."""
    from server.compile import resolve_config
    from shared.evaluate import measure_prior
    from shared.hf_models import load_model
    from shared.schemas import JobCreate

    spec = JobCreate(model="tiny", task="sst2", q=2, batch_size=4, seq_len=16, rank=2, calibrate=True)
    config = resolve_config(tiny_model_dir, spec.model_dump(mode="json"))
    model, tokenizer = load_model(tiny_model_dir)
    assert tuple(config["prior"]) == measure_prior(model, tokenizer, get_task("sst2"))
    plain = resolve_config(tiny_model_dir, spec.model_copy(update={"calibrate": False}).model_dump(mode="json"))
    assert "prior" not in plain and {k: v for k, v in config.items() if k != "prior"} == plain
