"""benchmarks/quantized_eval.py: two programs' zero-shot predictions, compared example by example."""

import json

import numpy as np

from benchmarks import quantized_eval
from tests.utils.programs import TINY_Q4, TINY_Q4_8DA4W


def _args(first, second, data, *extra: str) -> list[str]:
    return ["--programs", str(first), str(second), "--task", "sst2", "--eval", str(data), "--limit", "24", *extra]


def test_a_program_agrees_with_itself_and_its_figures_are_the_devices(program_factory, capsys):
    """The same program twice predicts the same on every example, with the accuracy and loss that the device's
    held-out evaluation (``evaluate_program``) reports for it; an 8da4w program of the model runs beside it."""
    from device_agent.et_program import ProgramSession
    from device_agent.evaluation import evaluate_program
    from device_agent.local_data import program_shape
    from shared.data import load_examples
    from shared.tasks import get_task, task_data_dir
    from shared.tokenizer_file import load_tokenizer_file

    data = task_data_dir() / "sst2" / "validation.jsonl"
    float_pte, manifest = program_factory(TINY_Q4)
    quant_pte, _ = program_factory(TINY_Q4_8DA4W)
    assert quantized_eval.main(_args(float_pte, float_pte, data, "--json")) == 0
    same = json.loads(capsys.readouterr().out)
    assert same["n"] == 24 and same["same_prediction"] == 1.0

    session = ProgramSession(float_pte, float_pte.parent / manifest.ptd.file)
    session.set_b(np.zeros(manifest.lora_size, np.float32))
    tokenizer = load_tokenizer_file(float_pte.parent / manifest.tokenizer.file)
    rendered = load_examples(get_task("sst2"), data, limit=24)
    shape, candidates = program_shape(manifest.config), manifest.config.candidates  # an SST-2 classification program
    device = evaluate_program(session, rendered, tokenizer, shape, "classification", candidates)
    expected = {"program": str(float_pte), "accuracy": device["accuracy"], "loss": device["loss"]}
    assert same["programs"] == [expected, expected]

    assert quantized_eval.main(_args(float_pte, quant_pte, data)) == 0
    assert "same prediction on" in capsys.readouterr().out
