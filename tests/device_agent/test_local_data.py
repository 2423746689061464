"""Local data: the job's file is found where documented, and every step's batch is the one ``mobizo train`` uses."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from device_agent.batches import Shape
from device_agent.local_data import find_train_file, program_shape, step_batches
from shared.errors import DataError
from shared.manifest import ProgramConfig

SST2_ROWS = [{"sentence": f"review number {i} was {'good' if i % 2 else 'bad'}", "label": i % 2} for i in range(11)]


def test_train_file_lookup_order(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="custom-abc/train.jsonl, custom/train.jsonl, custom-abc.jsonl, custom.jsonl"):
        find_train_file(tmp_path, "custom-abc", "custom")
    (tmp_path / "custom.jsonl").touch()
    assert find_train_file(tmp_path, "custom-abc", "custom") == tmp_path / "custom.jsonl"
    (tmp_path / "custom-abc").mkdir()
    (tmp_path / "custom-abc" / "train.jsonl").touch()
    assert find_train_file(tmp_path, "custom-abc", "custom") == tmp_path / "custom-abc" / "train.jsonl"


def test_program_shape_from_manifest_config() -> None:
    assert program_shape(ProgramConfig(batch_size=8, seq_len=16, answer_len=2, q=4)) == Shape(8, 16, 2)


def test_steps_are_mobizo_trains_batches_padded_to_the_program(tiny_model_dir: Path) -> None:
    """Same examples (batch_indices), same truncation (encode to seq_len), same seeds as shared.train."""
    from shared.data import batch_indices, encode, pad_token_id, training_batch
    from shared.hf_models import load_model
    from shared.noise import step_seed
    from shared.schedule import lr_at
    from shared.tasks import get_task

    _, tokenizer = load_model(tiny_model_dir)
    rendered = [get_task("sst2").render(row) for row in SST2_ROWS]
    shape = Shape(rows=4, seq_len=10, answer_len=2)
    # 24 rows: more than one epoch; a linear decay after 2 warm-up steps
    steps = list(step_batches(rendered, tokenizer, shape, 5, 6, 3e-3, "linear", warmup_steps=2, lr_floor=0.2))
    encoded = encode(rendered, tokenizer, shape.seq_len)
    assert len({got.lr for got in steps}) == 5  # the last warm-up step and the next both run at lr
    for k, got in enumerate(steps):
        chosen = [encoded[i] for i in batch_indices(len(encoded), 4, 5, k)]
        loose = training_batch(chosen, pad_token_id(tokenizer))  # padded to its own longest row, as train does
        width, answers = loose.input_ids.shape[1], loose.targets.shape[1]
        assert got.seed == step_seed(5, k)
        assert got.lr == lr_at(3e-3, 6, k, "linear", 2, 0.2) == float(np.float32(got.lr))  # the job's schedule
        assert got.input_ids.shape == (4, 10) and got.targets.shape == (4, 2)
        np.testing.assert_array_equal(got.input_ids[:, -width:], loose.input_ids.numpy())
        np.testing.assert_array_equal(got.attention_mask[:, :-width], 0)
        np.testing.assert_array_equal(got.targets[:, -answers:], loose.targets.numpy())
        np.testing.assert_array_equal(got.targets[:, :-answers], -100)


def test_bucketed_steps_take_the_bucketed_walks_examples(tiny_model_dir: Path) -> None:
    """``bucket``: the device picks each step's examples as ``shared.train`` does, from every example's length."""
    from shared.data import batch_indices, encode, pad_token_id, training_batch
    from shared.hf_models import load_model
    from shared.tasks import get_task

    _, tokenizer = load_model(tiny_model_dir)
    rendered = [get_task("sst2").render(row) for row in SST2_ROWS]
    shape = Shape(rows=4, seq_len=10, answer_len=2)
    encoded = encode(rendered, tokenizer, shape.seq_len)
    lengths = [len(e.prompt_ids) for e in encoded]
    steps = list(step_batches(rendered, tokenizer, shape, 5, 6, 3e-3, bucket=3))
    plain = list(step_batches(rendered, tokenizer, shape, 5, 6, 3e-3))
    for k, got in enumerate(steps):
        chosen = [encoded[i] for i in batch_indices(len(rendered), 4, 5, k, lengths, 3)]
        want = training_batch(chosen, pad_token_id(tokenizer), shape.seq_len, shape.answer_len)
        np.testing.assert_array_equal(got.input_ids, want.input_ids.numpy())
    assert any(not np.array_equal(a.input_ids, b.input_ids) for a, b in zip(steps, plain, strict=True))


def test_an_answer_longer_than_the_program_allows_is_an_error(tiny_model_dir: Path) -> None:
    from shared.hf_models import load_model
    from shared.tasks import get_task

    _, tokenizer = load_model(tiny_model_dir)
    lm = get_task("lm")
    rendered = [lm.render({"prompt": "Say", "completion": " a long answer of many many tokens"})]
    with pytest.raises(DataError, match="step 0: .*answer_len 2"):
        list(step_batches(rendered, tokenizer, Shape(rows=1, seq_len=32, answer_len=2), seed=0, steps=1, lr=0.1))


def test_the_held_out_slice_is_the_last_examples_and_at_most_a_fifth() -> None:
    from device_agent.local_data import split_held_out

    examples = list(range(50))
    assert split_held_out(examples, 5) == (list(range(45)), list(range(45, 50)))
    assert split_held_out(examples, 100) == (list(range(40)), list(range(40, 50)))  # a fifth: 10
    assert split_held_out(examples, 0) == (examples, [])
    assert split_held_out(examples[:4], 3) == (examples[:4], [])  # too little data to keep any out


def test_a_job_frames_its_local_data_as_its_program_says(tmp_path) -> None:
    """The chat frame comes with the program's config; the held-out slice is framed the same way."""
    from types import SimpleNamespace

    from device_agent.job import local_examples
    from shared.schemas import JobSpec

    (tmp_path / "sst2").mkdir()
    rows = [json.dumps({"sentence": f"film {i}", "label": i % 2}) for i in range(10)]
    (tmp_path / "sst2" / "train.jsonl").write_text("\n".join(rows) + "\n")
    spec = JobSpec(task="sst2", answer_len=1, eval_examples=2)
    lease = SimpleNamespace(spec=spec, manifest=SimpleNamespace(config=SimpleNamespace(chat=("<u>", "</u>"))))
    task, train, held = local_examples(SimpleNamespace(data_dir=tmp_path), lease)
    assert task.name == "sst2" and (len(train), len(held)) == (8, 2)
    assert held[-1].prompt == "<u>film 9 It was</u>" and held[-1].candidates == ["terrible", "great"]
