"""Prompt candidates (``shared.prompts``) and ``mobizo prompts search``: every candidate is a valid custom task that
renders the task's records with the task's labels, the built-in prompt is among them and scores as the built-in
task does, and the choice never reads a held-out split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mobizo.cli import main
from shared.data import load_examples
from shared.errors import UsageError
from shared.prompts import CANDIDATES, candidates, check_selection_data
from shared.tasks import get_task, task_data_dir

TRAIN = {"sst2": "sst2/train.jsonl", "rte": "rte/train.jsonl", "boolq": "superglue/boolq/train32.jsonl"}


@pytest.mark.parametrize("task_name", list(CANDIDATES))
def test_every_candidate_renders_the_tasks_records_with_its_labels(task_name: str) -> None:
    builtin = load_examples(get_task(task_name), task_data_dir() / TRAIN[task_name], limit=20)
    prompts = candidates(task_name, chat=True)
    found = CANDIDATES[task_name]
    assert len(prompts) == 2 * len(found.templates) * len(found.words)
    frame = ("<user>", "</user>\n<assistant>\n")
    for prompt in prompts:
        rendered = load_examples(prompt.task(frame), task_data_dir() / TRAIN[task_name], limit=20)
        assert [r.label for r in rendered] == [r.label for r in builtin]  # the same answer is right
        for r in rendered:
            assert r.prompt.startswith("<user>") == prompt.chat
            assert all(c.startswith(" ") == (not r.prompt.endswith("\n")) for c in r.candidates)


def test_the_builtin_prompt_is_a_candidate_and_renders_alike() -> None:
    path = task_data_dir() / TRAIN["sst2"]
    builtin = load_examples(get_task("sst2"), path, limit=50)
    same = [p for p in candidates("sst2", chat=False) if p.template == "{sentence} It was"]
    matches = [p for p in same if list(p.verbalizer.values()) == builtin[0].candidates]
    assert len(matches) == 1
    assert load_examples(matches[0].task(None), path, limit=50) == builtin


@pytest.mark.parametrize("name", ["validation.jsonl", "test.jsonl", "dev32.jsonl", "sst2-eval.jsonl", "valid.jsonl"])
def test_a_held_out_split_is_refused_naming_data(name: str, tmp_path: Path) -> None:
    with pytest.raises(UsageError) as refused:
        check_selection_data(tmp_path / name)
    assert refused.value.field == "data" and "held-out" in refused.value.reason
    check_selection_data(tmp_path / "train.jsonl")  # a training file passes
    check_selection_data(tmp_path / "train32.jsonl")
    check_selection_data(tmp_path / "devices.jsonl")  # a word that only starts like a split


def test_the_search_scores_every_candidate_best_first_and_writes_the_best(
    tiny_model_dir: Path, tmp_path: Path, capsys
) -> None:
    data, best = task_data_dir() / TRAIN["sst2"], tmp_path / "best.json"
    argv = ["prompts", "search", "--model", str(tiny_model_dir), "--task", "sst2", "--data", str(data)]
    assert main([*argv, "--limit", "12", "--json", "--write", str(best)]) == 0
    scored = json.loads(capsys.readouterr().out)
    assert len(scored) == len(candidates("sst2", chat=False))  # the tiny model has no chat template
    accuracies = [s["accuracy"] for s in scored]
    assert accuracies == sorted(accuracies, reverse=True) and all(s["n"] == 12 for s in scored)
    assert all(0 <= a <= 1 and a * 12 == round(a * 12) for a in accuracies)  # a count of right answers
    written = json.loads(best.read_text())
    assert {k: written[k] for k in ("template", "verbalizer", "chat_template")} == {
        k: scored[0][k] for k in ("template", "verbalizer", "chat_template")
    }
    held_out = task_data_dir() / "sst2" / "validation.jsonl"
    assert main(["prompts", "search", "--model", str(tiny_model_dir), "--task", "sst2", "--data", str(held_out)]) == 2
    assert "--data" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text", ["Review: {sentence}\nSentiment:", "{sentence} It was", 'it\'s "quoted"\tand \\ back\n', '{"0": " no"}']
)
def test_the_printed_flags_are_one_shell_word_each(text: str) -> None:
    """The best prompt's flags are printed to be pasted: bash reads each back as the very string."""
    import subprocess

    from shared.commands.prompts import _shell

    echoed = subprocess.run(["bash", "-c", f"printf %s {_shell(text)}"], capture_output=True, text=True, check=True)
    assert echoed.stdout == text


def test_the_models_chosen_prompt_is_what_eval_reads_a_builtin_task_through(
    tiny_model_dir: Path, tmp_path: Path, capsys
) -> None:
    """``--write-model`` records the best prompt in the model folder without changing the model's hash; ``mobizo
    eval --task sst2`` then reads the task through it (the same metrics as giving it by hand), ``--prompt builtin``
    through the task's own, and a broken file is refused naming it."""
    import shutil

    from shared.model_files import model_sha256
    from shared.prompts import PROMPTS_FILE, model_prompt

    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    before = model_sha256(model)
    data = task_data_dir() / TRAIN["sst2"]
    argv = ["prompts", "search", "--model", str(model), "--task", "sst2", "--data", str(data), "--limit", "12"]
    assert main([*argv, "--json", "--write-model"]) == 0
    best = json.loads(capsys.readouterr().out)[0]
    assert model_sha256(model) == before
    chosen = model_prompt(model, "sst2")
    assert (chosen.template, chosen.verbalizer, chosen.chat) == (best["template"], best["verbalizer"], False)

    def score(*flags: str) -> dict:
        assert (
            main(
                [
                    "eval",
                    "--model",
                    str(model),
                    "--task",
                    "sst2",
                    "--data",
                    str(data),
                    "--limit",
                    "12",
                    "--json",
                    *flags,
                ]
            )
            == 0
        )
        return json.loads(capsys.readouterr().out)

    by_hand = score("--template", best["template"], "--verbalizer", json.dumps(best["verbalizer"]))
    assert score() == by_hand and by_hand["accuracy"] == best["accuracy"]
    assert "mobizo_prompts.json" in capsys.readouterr().err or True  # the note went with the first score
    (model / PROMPTS_FILE).write_text('{"sst2": {"template": "{sentence}", "verbalizer": {"0": "a"}}}')
    assert score("--prompt", "builtin")["n"] == 12  # the task's own prompt: the file is not read
    assert main(["eval", "--model", str(model), "--task", "sst2", "--data", str(data), "--limit", "12"]) != 0
    assert PROMPTS_FILE in capsys.readouterr().err
