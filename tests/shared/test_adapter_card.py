"""An adapter carries its card: how it was prompted in training (``mobizo_card.json``, for programs) and a model
card (``README.md`` with the hub's front matter) for people; ``mobizo eval --adapter`` prompts with the card's
prompt unless told otherwise. (The server writes the card into every archive: tests/server/test_results.py.)"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mobizo.cli import main
from shared.adapter import CARD_DATA, CARD_FILE, adapter_card, save_lora
from shared.errors import MobizoError
from shared.hf_models import load_model
from shared.lora import inject_lora
from shared.model_files import model_sha256
from shared.tasks import task_data_dir

REWORDED = {"template": "Review: {sentence}\nVerdict:", "verbalizer": {"0": " bad", "1": " good"}}


def _card(template: str | None, verbalizer: dict | None) -> dict:
    prompt = {"template": template, "verbalizer": verbalizer, "chat_template": False, "objective": "classification"}
    provenance = {"job_id": 7, "steps": 200, "device_backend": "executorch", "dp_epsilon": None}
    return {"task": "sst2", "prompt": prompt | {"prior": []}, "provenance": provenance | {"replay_verified": True}}


@pytest.fixture(scope="module")
def adapter(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pinned adapter of the tiny model trained (here: B drawn) on a reworded SST-2 prompt, with its card."""
    model, _ = load_model(tiny_model_dir)
    lora = inject_lora(model, ("q_proj", "v_proj"), rank=2, alpha=4.0)
    torch.manual_seed(1)
    b = torch.randn(lora.size)
    folder = tmp_path_factory.mktemp("card") / "adapter"
    card = _card(REWORDED["template"], REWORDED["verbalizer"])
    return save_lora(folder, lora, b, "tiny", model_sha256(tiny_model_dir), card=card)


def test_the_card_says_how_to_prompt_it_and_where_it_came_from(adapter: Path) -> None:
    card = adapter_card(adapter)
    assert card == _card(REWORDED["template"], REWORDED["verbalizer"])
    text = (adapter / CARD_FILE).read_text()
    front, body = text.split("---\n")[1], text.split("---\n", 2)[2]
    assert 'base_model: "tiny"' in front and "library_name: peft" in front
    from markdown_it import MarkdownIt

    cells = dict(_cells(MarkdownIt("commonmark").enable("table").parse(body)))
    assert cells["template"] == json.dumps(REWORDED["template"]) and cells["job id"] == "7"
    assert "dp epsilon" not in cells


def _eval(model: Path, adapter: Path, *extra: str) -> list[str]:
    data = task_data_dir() / "sst2" / "validation.jsonl"
    return ["eval", "--model", str(model), "--adapter", str(adapter), "--task", "sst2", "--data", str(data)] + [
        "--limit",
        "16",
        "--json",
        *extra,
    ]


def test_eval_prompts_with_the_cards_prompt_unless_told(tiny_model_dir: Path, adapter: Path, capsys) -> None:
    explicit = ("--template", REWORDED["template"], "--verbalizer", json.dumps(REWORDED["verbalizer"]))
    assert main(_eval(tiny_model_dir, adapter, *explicit)) == 0
    told = json.loads(capsys.readouterr().out)
    assert main(_eval(tiny_model_dir, adapter)) == 0
    captured = capsys.readouterr()
    by_card = json.loads(captured.out)
    assert CARD_DATA in captured.err and "the prompt the adapter was trained with" in captured.err
    assert by_card == told
    assert main(_eval(tiny_model_dir, adapter, "--prompt", "builtin")) == 0
    assert json.loads(capsys.readouterr().out) != told  # the task's own prompt reads otherwise
    assert (
        main(
            _eval(
                tiny_model_dir,
                adapter,
                "--template",
                "{sentence} It was",
                "--verbalizer",
                '{"0": " bad", "1": " good"}',
            )
        )
        == 0
    )
    assert CARD_DATA not in capsys.readouterr().err  # what the user gives wins


def test_a_card_of_the_tasks_own_prompt_reads_the_task_as_built(tiny_model_dir: Path, adapter: Path, tmp_path) -> None:
    builtin = Path(shutil.copytree(adapter, tmp_path / "builtin"))
    (builtin / CARD_DATA).write_text(json.dumps(_card(None, None)))
    assert main(_eval(tiny_model_dir, builtin)) == 0
    assert main(_eval(tiny_model_dir, builtin, "--prompt", "builtin")) == 0


def test_eval_divides_out_the_prior_the_adapter_trained_with(tiny_model_dir: Path, adapter: Path, tmp_path, capsys):
    """A calibrated adapter's card carries its prior; eval divides it out of the answers' scores (a prior that all
    but rules out one answer makes every prediction the other), and the task's own prompt drops it."""
    labels = [json.loads(line)["label"] for line in (task_data_dir() / "sst2" / "validation.jsonl").open()][:16]
    for prior, chosen in (([0.0, -50.0], 1), ([-50.0, 0.0], 0)):
        calibrated = Path(shutil.copytree(adapter, tmp_path / f"calibrated-{chosen}"))
        card = _card(REWORDED["template"], REWORDED["verbalizer"])
        card["prompt"]["prior"] = prior
        (calibrated / CARD_DATA).write_text(json.dumps(card))
        assert main(_eval(tiny_model_dir, calibrated)) == 0
        captured = capsys.readouterr()
        scored = json.loads(captured.out)
        assert "calibrated by its prior" in captured.err and scored["prior"] == prior
        assert scored["accuracy"] == labels.count(chosen) / len(labels)
        assert main(_eval(tiny_model_dir, calibrated, "--prompt", "builtin")) == 0
        assert "prior" not in json.loads(capsys.readouterr().out)


def test_a_malformed_card_is_an_error_naming_the_file(adapter: Path, tmp_path: Path) -> None:
    broken = Path(shutil.copytree(adapter, tmp_path / "broken"))
    (broken / CARD_DATA).write_text('{"task": "sst2"}')
    with pytest.raises(MobizoError, match=CARD_DATA):
        adapter_card(broken)


def test_mobizo_train_writes_the_card_of_its_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    from shared.train import TrainConfig, train

    sst2 = task_data_dir() / "sst2" / "train.jsonl"
    template, verbalizer = REWORDED["template"], REWORDED["verbalizer"]
    config = TrainConfig(tiny_model_dir, "sst2", sst2, tmp_path, steps=1, batch_size=2, q=1, limit_train=4)
    train(replace(config, template=template, verbalizer=verbalizer), progress=False)
    (card,) = [adapter_card(p.parent) for p in tmp_path.rglob(CARD_DATA)]
    assert card["task"] == "sst2" and card["prompt"]["template"] == template
    assert card["prompt"]["verbalizer"] == verbalizer and card["prompt"]["chat_template"] is False
    assert card["provenance"] == {"method": "mobizo", "steps": 1, "dp_epsilon": None}


HOSTILE = (
    "x` | <img src=x onerror=alert(1)> ![i](javascript:alert(1)) [l](javascript:alert(2)) <script>alert(3)</script>"
    " ``` &amp; &#60;b&#62; <https://evil.example> *em* _u_ \\` \\| |\n| injected | row |\r\n# heading"
)


def _cells(tokens) -> list[list[str]]:
    """The rows of a parsed document's tables, each cell's text as a reader sees it."""
    rows, row, inside = [], [], False
    for token in tokens:
        if token.type == "tr_open":
            row = []
        elif token.type in ("th_open", "td_open"):
            inside = True
        elif token.type in ("th_close", "td_close"):
            inside = False
        elif token.type == "inline" and inside:
            row.append("".join(c.content for c in token.children if c.type in ("text", "code_inline")))
        elif token.type == "tr_close":
            rows.append(row)
    return rows


def test_the_readme_shows_a_users_text_as_text_and_nothing_else(tmp_path: Path) -> None:
    """A template, answers or a device's backend holding backticks, ``|``, HTML, images, links, entities or line
    breaks stay text in their table cells of ``README.md`` (CommonMark with tables, GitHub's; and the Markdown of
    the docs' site): no code span opens, no cell or row is added, no HTML, image or link comes out."""
    from markdown import markdown
    from markdown_it import MarkdownIt

    from shared.adapter import make_card, write_card

    labels = {"0`|<b>": " bad` | ![x](y)", "1": "[z](javascript:q)\n|x|"}
    card = make_card(
        "custom`|<i>", HOSTILE, labels, False, "classification", [0.25, 0.75], job_id=3, device_backend=HOSTILE
    )
    write_card(tmp_path, "tiny` <b>|", card)
    text = (tmp_path / CARD_FILE).read_text()
    front, body = text.split("---\n")[1], text.split("---\n", 2)[2]
    assert json.loads(front.splitlines()[0].removeprefix("base_model: ")) == "tiny` <b>|"  # YAML takes JSON's form
    tokens = MarkdownIt("commonmark").enable("table").parse(body)
    found = {t.type for t in tokens} | {c.type for t in tokens if t.children for c in t.children}
    assert not found & {"html_inline", "html_block", "image", "link_open", "fence", "code_block"}, found
    spans = {c.content for t in tokens if t.children for c in t.children if c.type == "code_inline"}
    assert spans == {CARD_DATA, "mobizo eval --adapter"}  # the card's own, none of the user's
    rows = _cells(tokens)
    assert all(len(row) == 2 for row in rows), rows
    cells = dict(rows)
    assert cells["template"] == json.dumps(HOSTILE) and cells["verbalizer"] == json.dumps(labels)
    assert cells["task"] == "custom`|<i>" and cells["device backend"] == HOSTILE.replace("\r", "\\r").replace(
        "\n", "\\n"
    )
    assert cells["calibration prior"] == "[0.25, 0.75]" and "injected" not in cells
    (title,) = [t for t in tokens if t.type == "inline" and t.content.startswith("A personal")]
    assert "".join(c.content for c in title.children) == "A personal custom`|<i> adapter of tiny` <b>|"

    html = markdown(body, extensions=["tables"])
    assert not any(tag in html for tag in ("<img", "<script", "<a ", "<b>", "<i>", "href=")), html
