"""Prompt candidates for the built-in classification tasks, and choosing among them by zero-shot accuracy on
training rows (``mobizo prompts search``).

Where learning starts is the prompt's: SmolLM2-135M-Instruct reads SST-2 at chance with the built-in
``"{sentence} It was"`` / " terrible", " great" (MeZO's template), and far better with a template and answers that
say what is asked. Each task here has a few templates and verbalizers (the built-in one among them), each tried with
and without the model's chat frame; every candidate is the built-in task read through another prompt
(``shared.tasks.get_task(task, template, verbalizer)``: the same records, labels and data folder), so whatever is
chosen is given to a job, ``mobizo train`` or ``mobizo eval`` as ``--task TASK --template ... --verbalizer ...
[--chat-template]``.

A model folder may hold the prompt chosen for each task (``PROMPTS_FILE``, written by ``mobizo prompts search
--write-model``; ``mobizo models import --smollm2`` writes the one measured here, ``MEASURED``). A job, ``mobizo
train``, ``mobizo eval`` and ``mobizo export`` that name a built-in task and no prompt of their own read the task
through it (``resolve``); ``prompt="builtin"`` (``--prompt builtin``) keeps the task's own. The file is not part
of the model's hash: choosing a prompt does not make the weights another model.

The choice reads training rows only: a file named like a held-out split (``validation``, ``test``, ``dev``,
``eval``) is refused (``check_selection_data``), so that the score a chosen prompt then gets on held-out rows is
not a score it was chosen by.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.errors import DataError, UsageError
from shared.files import atomic_write_bytes
from shared.tasks import Task, get_task, with_chat

PROMPTS_FILE = "mobizo_prompts.json"  # in a model folder: task → the prompt chosen for the model

HELD_OUT = re.compile(r"(^|[^a-z])(validation|valid|test|dev|eval)(?![a-z])", re.IGNORECASE)


@dataclass(frozen=True)
class Candidates:
    """A task's templates (custom templates over its fields), its answer words in label order, and the label
    values (as ``shared.tasks`` matches them) those words stand for."""

    templates: tuple[str, ...]
    words: tuple[tuple[str, ...], ...]
    labels: tuple[str, ...]


CANDIDATES: dict[str, Candidates] = {
    "sst2": Candidates(
        templates=(
            "{sentence} It was",  # the built-in (MeZO's)
            "Review: {sentence}\nSentiment:",
            "{sentence}\nIs this review positive or negative?\nAnswer:",
        ),
        words=(("terrible", "great"), ("bad", "good"), ("negative", "positive")),
        labels=("0", "1"),
    ),
    "rte": Candidates(
        templates=(
            '{premise}\nDoes this mean that "{hypothesis}" is true? Yes or No?\n',  # the built-in
            "{premise}\nQuestion: {hypothesis} True or False?\nAnswer:",
        ),
        words=(("Yes", "No"), ("True", "False")),
        labels=("0", "1"),  # 0 entailment
    ),
    "boolq": Candidates(
        templates=("{passage}\nQuestion: {question}?\nAnswer:", "{passage}\n{question}? Yes or No?\n"),
        words=(("No", "Yes"), ("False", "True")),
        labels=("false", "true"),
    ),
}


@dataclass(frozen=True)
class Prompt:
    """A built-in task read through a template over its fields, a verbalizer (label value → answer text) and,
    when ``chat``, the model's chat frame."""

    task_name: str
    template: str
    verbalizer: dict[str, str]
    chat: bool

    def task(self, frame: tuple[str, str] | None) -> Task:
        """The task of this prompt; ``frame``: the model's chat frame, used when ``chat``."""
        return with_chat(get_task(self.task_name, self.template, self.verbalizer), frame if self.chat else None)

    def as_dict(self) -> dict:
        return {"template": self.template, "verbalizer": self.verbalizer, "chat_template": self.chat}


# What ``mobizo prompts search`` chose for the models ``mobizo models import`` brings, with the scores it was chosen
# by (zero-shot accuracy on the first 300 rows of SST-2's training split) and its zero-shot accuracy on the 872
# validation sentences, which the choice never read (docs/guide/jobs.md, "Choosing a prompt"). RTE and BoolQ: no
# candidate beat the majority answer on held-out rows, so those tasks keep their own prompts.
MEASURED: dict[str, dict[str, dict[str, Any]]] = {
    "SmolLM2-135M-Instruct": {
        "sst2": {
            "template": "Review: {sentence}\nSentiment:",
            "verbalizer": {"0": " negative", "1": " positive"},
            "chat_template": False,
            "chosen_on": "sst2/train.jsonl, first 300 rows",
            "accuracy": 0.770,
            "validation_accuracy": 0.786,
        }
    }
}


def _answer(template: str, word: str) -> str:
    """An answer continues the prompt's line with a space, and starts a new line without one (``shared.tasks``)."""
    return word if template.endswith("\n") else " " + word


def candidates(task_name: str, chat: bool) -> list[Prompt]:
    """Every candidate prompt of a built-in task (each template with each verbalizer; also in the chat frame when
    ``chat``); ``UsageError`` naming ``task`` for a task without candidates."""
    found = CANDIDATES.get(task_name)
    if found is None:
        raise UsageError("task", f"no prompt candidates for {task_name!r}; choose from {', '.join(CANDIDATES)}")
    prompts = []
    for in_chat in (False, True) if chat else (False,):
        for template in found.templates:
            for words in found.words:
                verbalizer = {label: _answer(template, w) for label, w in zip(found.labels, words, strict=True)}
                prompts.append(Prompt(task_name, template, verbalizer, in_chat))
    return prompts


def check_selection_data(path: Path) -> None:
    """A prompt is chosen on training rows: ``UsageError`` naming ``data`` for a file whose name says it is a
    held-out split (``validation.jsonl``, ``dev32.jsonl``, ``sst2-test.jsonl``, ...)."""
    if HELD_OUT.search(path.stem):
        raise UsageError(
            "data",
            f"{path.name} looks like a held-out split: choose the prompt on training rows, so that its held-out "
            "score is not the one it was chosen by",
        )


def _prompt_of(task_name: str, entry: Any, where: Path) -> Prompt:
    """``entry`` of a prompts file as a checked ``Prompt``; ``DataError`` naming the file and task otherwise."""
    try:
        if not isinstance(entry, dict) or not isinstance(entry.get("chat_template", False), bool):
            raise UsageError("prompt", "must be an object with template, verbalizer and chat_template")
        prompt = Prompt(task_name, entry.get("template"), entry.get("verbalizer"), entry.get("chat_template", False))
        if not isinstance(prompt.template, str):
            raise UsageError("template", "must be a string")
        prompt.task(None)  # the task's own check of the template and the answers
    except UsageError as exc:
        raise DataError(f"{where}: {task_name}: {exc.field}: {exc.reason}") from None
    return prompt


def model_prompts(model_dir: Path) -> dict[str, dict[str, Any]]:
    """The model folder's ``PROMPTS_FILE`` as it is (empty without one); ``DataError`` for a file that is not a
    JSON object of objects."""
    path = Path(model_dir) / PROMPTS_FILE
    if not path.is_file():
        return {}
    try:
        found = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: not JSON ({exc})") from None
    if not isinstance(found, dict):
        raise DataError(f"{path}: must be an object of task → prompt")
    return found


def model_prompt(model_dir: Path, task_name: str) -> Prompt | None:
    """The prompt chosen for ``task_name`` on the model in ``model_dir`` (None: none chosen)."""
    entry = model_prompts(model_dir).get(task_name)
    return None if entry is None else _prompt_of(task_name, entry, Path(model_dir) / PROMPTS_FILE)


def write_model_prompt(model_dir: Path, task_name: str, entry: dict[str, Any]) -> Path:
    """Record ``entry`` (template, verbalizer, chat_template and how it was chosen) as the model's prompt for
    ``task_name``, keeping the other tasks' (atomically) → the file."""
    _prompt_of(task_name, entry, Path(model_dir) / PROMPTS_FILE)
    found = model_prompts(model_dir) | {task_name: entry}
    return atomic_write_bytes(Path(model_dir) / PROMPTS_FILE, (json.dumps(found, indent=2) + "\n").encode())


def trained_prompt(
    task_name: str, template: str | None, verbalizer: dict | None, chat: bool, choice: str, trained: dict | None
) -> dict | None:
    """The prompt an adapter was trained with (``trained``: its card, ``shared.adapter.make_card``), when a run of
    ``task_name`` reads through it: the run gave no prompt of its own nor asked for the task's (``choice``
    builtin), and the adapter was trained on this task."""
    if trained is None or choice == "builtin" or template is not None or verbalizer is not None or chat:
        return None
    return trained["prompt"] if trained["task"] == task_name else None


def trained_line(prompt: dict) -> str:
    """What a run says on stderr when it reads a task through an adapter's trained prompt."""
    used = "the task's own" if prompt["template"] is None else repr(prompt["template"])
    frame = ", in the model's chat frame" if prompt["chat_template"] else ""
    calibrated = ", calibrated by its prior" if prompt.get("prior") else ""
    return f"the prompt the adapter was trained with: {used}{frame}{calibrated}"


def resolve(
    model_dir: Path | None,
    task_name: str,
    template: str | None,
    verbalizer: dict | None,
    chat: bool,
    choice: str = "model",
    trained: dict | None = None,
) -> tuple[str | None, dict | None, bool]:
    """(template, verbalizer, chat) a run reads ``task_name`` through: what it gave (``choice`` "builtin": the
    task's own); else, for an adapter's run, the prompt it was trained with (``trained_prompt``); else, for a
    built-in task, the model's chosen prompt where it has one (``model_dir`` None: none)."""
    if choice == "builtin" or template is not None or verbalizer is not None or chat or task_name == "custom":
        return template, verbalizer, chat
    if (prompt := trained_prompt(task_name, template, verbalizer, chat, choice, trained)) is not None:
        return prompt["template"], prompt["verbalizer"], bool(prompt["chat_template"])
    prompt = None if model_dir is None else model_prompt(model_dir, task_name)
    return (template, verbalizer, chat) if prompt is None else (prompt.template, prompt.verbalizer, prompt.chat)


def notice(task_name: str, given: str | None, used: str | None) -> str | None:
    """A line for stderr when a run reads ``task_name`` through the model's prompt rather than one it gave."""
    if given is not None or used is None:
        return None
    return (
        f"{task_name}: the prompt chosen for this model ({PROMPTS_FILE}): {used!r} (--prompt builtin: the task's own)"
    )
