"""Prompt candidates for the built-in classification tasks, and choosing among them by zero-shot accuracy on
training rows (``mobizo prompts search``).

Where learning starts is the prompt's: SmolLM2-135M-Instruct reads SST-2 at chance with the built-in
``"{sentence} It was"`` / " terrible", " great" (MeZO's template), and far better with a template and answers that
say what is asked. Each task here has a few templates and verbalizers (the built-in one among them), each tried with
and without the model's chat frame; every candidate is a custom task (``shared.tasks.get_task("custom", ...)``), so
whatever is chosen is given to a job, ``mobizo train`` or ``mobizo eval`` as ``--task custom --template ...
--verbalizer ... [--chat-template]``.

The choice reads training rows only: a file named like a held-out split (``validation``, ``test``, ``dev``,
``eval``) is refused (``check_selection_data``), so that the score a chosen prompt then gets on held-out rows is
not a score it was chosen by.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from shared.errors import UsageError
from shared.tasks import Task, get_task, with_chat

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
    """One candidate: a custom template, its verbalizer (label value → answer text) and whether the prompt sits
    inside the model's chat frame."""

    template: str
    verbalizer: dict[str, str]
    chat: bool

    def task(self, frame: tuple[str, str] | None) -> Task:
        """The custom task of this prompt; ``frame``: the model's chat frame, used when ``chat``."""
        return with_chat(get_task("custom", self.template, self.verbalizer), frame if self.chat else None)

    def as_dict(self) -> dict:
        return {"template": self.template, "verbalizer": self.verbalizer, "chat_template": self.chat}


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
                prompts.append(Prompt(template, verbalizer, in_chat))
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
