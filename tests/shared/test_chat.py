"""Chat templates as a task option: the frame around one user message, and ``--chat-template`` on the commands."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from mobizo.cli import build_parser, main
from shared.errors import UsageError
from shared.tasks import Rendered, chat_frame, get_task, task_data_dir, with_chat

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}<|assistant|>\n"
SST2 = task_data_dir() / "sst2" / "validation.jsonl"


@pytest.fixture(scope="module")
def chat_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a chat template (an instruct model's tokenizer carries one)."""
    folder = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return folder


def test_the_frame_wraps_the_prompt_and_answers_lose_their_space(chat_model: Path) -> None:
    frame = chat_frame(AutoTokenizer.from_pretrained(chat_model))
    assert frame == ("<|user|>\n", "\n<|assistant|>")  # Jinja drops a template's final newline
    task = with_chat(get_task("sst2"), frame)
    rendered = task.render({"sentence": "a fine film", "label": 1})
    assert rendered == Rendered("<|user|>\na fine film It was\n<|assistant|>", ["terrible", "great"], 1)
    assert with_chat(get_task("sst2"), None) is get_task("sst2")


def test_a_tokenizer_without_a_template_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(UsageError, match="no chat template") as error:
        chat_frame(AutoTokenizer.from_pretrained(tiny_model_dir))
    assert error.value.argument == "--chat-template"


def test_eval_with_and_without_the_template(chat_model: Path, tiny_model_dir: Path, capsys) -> None:
    common = ["eval", "--task", "sst2", "--data", str(SST2), "--limit", "8", "--json"]
    assert main([*common, "--model", str(chat_model)]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*common, "--model", str(chat_model), "--chat-template"]) == 0
    chat = json.loads(capsys.readouterr().out)
    assert plain["n"] == chat["n"] == 8 and plain["loss"] != chat["loss"]  # other prompts, other answer tokens
    assert main([*common, "--model", str(tiny_model_dir), "--chat-template"]) == 2
    assert "--chat-template" in capsys.readouterr().err


def test_train_records_the_option(chat_model: Path, tmp_path: Path, capsys) -> None:
    args = ["train", "--model", str(chat_model), "--task", "sst2", "--train", str(SST2), "--limit-train", "8"]
    args += ["--steps", "1", "--batch-size", "4", "--out", str(tmp_path), "--chat-template", "--json"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["chat_template"] is True


def test_export_config_and_job_spec_carry_it(chat_model: Path) -> None:
    from server.commands.jobs import job_body
    from shared.commands.export import config_from_args

    parser = build_parser()
    export = parser.parse_args(
        ["export", "--model", str(chat_model), "--task", "sst2", "--q", "2", "--batch-size", "4", "--seq-len", "32"]
        + ["--out", "x.pte", "--chat-template"]
    )
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    assert config_from_args(export, tokenizer).chat == chat_frame(tokenizer)
    submit = parser.parse_args(["jobs", "submit", "--model", "m", "--task", "sst2", "--chat-template"])
    assert job_body(submit)["chat_template"] is True
    plain = parser.parse_args(["jobs", "submit", "--model", "m", "--task", "sst2"])
    assert "chat_template" not in job_body(plain)
