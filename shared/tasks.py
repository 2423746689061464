"""Task templates and verbalizers: how one data record becomes a prompt and the candidate answers to score.

Classification is next-token prediction with a verbalizer (the MobiZO/MeZO setup): the model reads the prompt and
we compare the likelihood of each candidate answer. The built-in templates follow MeZO's (PromptSource-derived)
ones so that our accuracies compare with the paper's. A candidate starts with a space exactly when the template
leaves the space to the answer (``"... It was"`` → ``" great"``), and never when the prompt ends with a newline.

Label values are matched as strings: JSON integers by their digits, JSON booleans as ``"true"``/``"false"``.
The built-in tasks accept both the label spellings of the task data (``task_data_dir()``: the GLUE and FewGLUE
files) and the integer ids of the Hugging Face copies of the same benchmarks. A record that does not fit its task
raises ``DataError`` naming the field; ``shared.data.load_examples`` adds the file and line.

One task's record is several rows: ``text``, the user's own text (``{"text": ..., "context": ...}``, the context
optional), trains the language-modelling objective on each line of the text given what comes before it (the
context, a blank line, the text's earlier lines): ``Task.rows``, ``text_pieces``; docs/guide/jobs.md says why.
"""

from __future__ import annotations

import json
import os
import re
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from shared.errors import DataError, UsageError

Kind = Literal["classification", "multiple_choice", "lm"]


@dataclass(frozen=True)
class Rendered:
    """A record as text: the prompt, the candidate answers, and which candidate is right."""

    prompt: str
    candidates: list[str]  # classification: verbalizer in label order; multiple_choice: the choices; lm: [completion]
    label: int  # index into candidates (0 for lm)


@dataclass(frozen=True)
class Task:
    """A named way of rendering records; ``fields`` are the record fields it needs (dotted paths reach inside),
    ``labels`` the label values it accepts, as strings (empty for ``lm``)."""

    name: str
    kind: Kind
    fields: tuple[str, ...]
    render_record: Callable[[Mapping[str, Any]], Rendered] = field(repr=False, compare=False)
    labels: tuple[str, ...] = ()
    # A built-in classification task's label spellings per answer, in answer order (what another prompt of the same
    # task maps its verbalizer onto: ``get_task(name, template, verbalizer)``); empty for other tasks.
    classes: tuple[tuple[str, ...], ...] = ()
    # A task whose record is several rows (``text``: a row per line of the user's text); None: one row per record.
    render_rows: Callable[[Mapping[str, Any]], list[Rendered]] | None = field(default=None, repr=False, compare=False)

    def render(self, record: Mapping[str, Any]) -> Rendered:
        """The record as prompt + candidates; ``DataError`` naming the first missing or unusable field."""
        for path in self.fields:
            _field(record, path)
        return self.render_record(record)

    def rows(self, record: Mapping[str, Any]) -> list[Rendered]:
        """The rows a record trains and scores: ``[render(record)]``, or a ``text`` record's row per line."""
        if self.render_rows is None:
            return [self.render(record)]
        for path in self.fields:
            _field(record, path)
        return self.render_rows(record)


def _field(record: Mapping[str, Any], path: str) -> Any:
    """Value at a dotted path such as ``target.span1_text``."""
    value: Any = record
    for key in path.split("."):
        if not isinstance(value, Mapping) or key not in value:
            raise DataError(f"missing field {path!r}")
        value = value[key]
    return value


def _text(record: Mapping[str, Any], path: str) -> str:
    """A text field; numbers are accepted as their decimal text (useful in custom templates)."""
    value = _field(record, path)
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    raise DataError(f"field {path!r} must be a string, got {type(value).__name__}")


def _label_key(value: Any) -> str | None:
    """The string a label value is matched by (None for values that are never labels, such as floats)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | str):
        return str(value)
    return None


def _label_index(record: Mapping[str, Any], index: Mapping[str, int]) -> int:
    value = _field(record, "label")
    key = _label_key(value)
    if key is None or key not in index:
        raise DataError(f"field 'label': {value!r} is not one of {', '.join(index)}")
    return index[key]


def _classification(
    name: str,
    fields: tuple[str, ...],
    prompt: Callable[[Mapping[str, Any]], str],
    verbalizer: Sequence[str],
    label_values: Sequence[Sequence[str]],
) -> Task:
    """A verbalizer task; ``label_values[i]`` are the label spellings that mean candidate i."""
    candidates = list(verbalizer)
    index = {key: i for i, keys in enumerate(label_values) for key in keys}

    def render(record: Mapping[str, Any]) -> Rendered:
        return Rendered(prompt(record), list(candidates), _label_index(record, index))

    classes = tuple(tuple(keys) for keys in label_values)
    return Task(name, "classification", (*fields, "label"), render, tuple(index), classes)


def _nli_prompt(premise: str, hypothesis: str) -> Callable[[Mapping[str, Any]], str]:
    """RTE's template (also WNLI's: same sentence-pair entailment question)."""

    def prompt(r: Mapping[str, Any]) -> str:
        return f'{_text(r, premise)}\nDoes this mean that "{_text(r, hypothesis)}" is true? Yes or No?\n'

    return prompt


def _sst2_prompt(r: Mapping[str, Any]) -> str:
    return f"{_text(r, 'sentence').strip()} It was"


def _boolq_prompt(r: Mapping[str, Any]) -> str:
    question = _text(r, "question").strip()
    question = question[:1].upper() + question[1:]
    return f"{_text(r, 'passage')} {question if question.endswith('?') else question + '?'}"


def _wic_prompt(r: Mapping[str, Any]) -> str:
    return (
        f'Does the word "{_text(r, "word")}" have the same meaning in these two sentences? Yes, No?\n'
        f"{_text(r, 'sentence1')}\n{_text(r, 'sentence2')}\n"
    )


def _wsc_prompt(r: Mapping[str, Any]) -> str:
    pronoun, noun = _text(r, "target.span2_text").lower(), _text(r, "target.span1_text")
    return f'{_text(r, "text")}\nIn the previous sentence, does the pronoun "{pronoun}" refer to {noun}? Yes or No?\n'


def _cb_prompt(r: Mapping[str, Any]) -> str:
    return f'Suppose {_text(r, "premise")} Can we infer that "{_text(r, "hypothesis")}"? Yes, No, or Maybe?\n'


def _lower_first(sentence: str) -> str:
    """COPA choices continue the premise mid-sentence, so their first word loses its capital (but not "I")."""
    first = sentence.split(" ", 1)[0]
    if first == "I" or first.startswith("I'"):
        return sentence
    return sentence[:1].lower() + sentence[1:]


def _copa_render(r: Mapping[str, Any]) -> Rendered:
    """Premise (final period dropped) + " so"/" because"; each candidate is a choice continuing that sentence."""
    conjunction = {"effect": " so", "cause": " because"}.get(_text(r, "question"))
    if conjunction is None:
        raise DataError(f"field 'question': {r['question']!r} is not one of cause, effect")
    premise = _text(r, "premise").rstrip()
    premise = premise[:-1] if premise.endswith(".") else premise
    choices = [" " + _lower_first(_text(r, key).strip()) for key in ("choice1", "choice2")]
    return Rendered(premise + conjunction, choices, _label_index(r, {"0": 0, "1": 1}))


def _lm_render(r: Mapping[str, Any]) -> Rendered:
    """Plain personalization data: the loss covers the completion tokens only."""
    completion = _text(r, "completion")
    if not completion:
        raise DataError("field 'completion' is empty: there is nothing to learn or score")
    return Rendered(_text(r, "prompt"), [completion], 0)


# The user's own text (``text``): what each row predicts and what it reads first.
TEXT_BREAK = "\n\n"  # between the context and the text (and before a text without one)
TEXT_PIECE_CHARS = 64  # a line longer than this is cut into pieces of at most this many characters


def text_pieces(text: str, max_chars: int = TEXT_PIECE_CHARS) -> list[str]:
    """A text as the pieces its rows predict, in order: each line with the line breaks after it (a blank line
    belongs to the line before), a line longer than ``max_chars`` cut before a space (or at ``max_chars`` when it
    has none in reach). Their concatenation is the text, with a final line break added when it has none."""
    if max_chars < 1:
        raise ValueError(f"max_chars must be at least 1, got {max_chars}")
    text = text if text.endswith("\n") else text + "\n"
    pieces = []
    for line in re.findall(r"[^\n]*\n+", text):
        content, breaks = line.rstrip("\n"), line[len(line.rstrip("\n")) :]
        while len(content) > max_chars:
            cut = content.rfind(" ", 1, max_chars + 1)
            cut = cut if cut > 0 else max_chars
            pieces.append(content[:cut])
            content = content[cut:]
        pieces.append(content + breaks)
    return pieces


def _text_rows(r: Mapping[str, Any]) -> list[Rendered]:
    """The user's own text, a row per piece (``text_pieces``): the piece given the context, a blank line and the
    text before it. Every character of the text is predicted once, so the rows' token loss is the text's."""
    text = _text(r, "text")
    if not text.strip():
        raise DataError("field 'text' is empty: there is nothing to learn or score")
    context = "" if r.get("context") is None else _text(r, "context")
    before = context + TEXT_BREAK
    rows = []
    for piece in text_pieces(text):
        rows.append(Rendered(before, [piece], 0))
        before += piece
    return rows


def _one_row_of_text(r: Mapping[str, Any]) -> Rendered:
    raise DataError("a text record is a row per line: read it with Task.rows (shared.data.load_examples)")


_BOOL = (("false", "0"), ("true", "1"))  # SuperGLUE JSON booleans; 0/1 in the Hugging Face copies
_NLI3 = (("entailment", "0"), ("contradiction", "1"), ("neutral", "2"))  # CB, in SuperGLUE's label order

_BUILTINS: dict[str, Task] = {
    "sst2": _classification("sst2", ("sentence",), _sst2_prompt, [" terrible", " great"], [("0",), ("1",)]),
    # GLUE RTE: 0 = entailment → "Yes", 1 = not_entailment → "No".
    "rte": _classification(
        "rte",
        ("premise", "hypothesis"),
        _nli_prompt("premise", "hypothesis"),
        ["Yes", "No"],
        [("0", "entailment"), ("1", "not_entailment")],
    ),
    # GLUE WNLI is the other way round: 1 = entailment.
    "wnli": _classification(
        "wnli",
        ("sentence1", "sentence2"),
        _nli_prompt("sentence1", "sentence2"),
        ["No", "Yes"],
        [("0", "not_entailment"), ("1", "entailment")],
    ),
    "boolq": _classification("boolq", ("passage", "question"), _boolq_prompt, [" No", " Yes"], _BOOL),
    "wic": _classification("wic", ("word", "sentence1", "sentence2"), _wic_prompt, ["No", "Yes"], _BOOL),
    "wsc": _classification(
        "wsc", ("text", "target.span1_text", "target.span2_text"), _wsc_prompt, ["No", "Yes"], _BOOL
    ),
    "cb": _classification("cb", ("premise", "hypothesis"), _cb_prompt, ["Yes", "No", "Maybe"], _NLI3),
    "copa": Task(
        "copa", "multiple_choice", ("premise", "choice1", "choice2", "question", "label"), _copa_render, ("0", "1")
    ),
    "lm": Task("lm", "lm", ("prompt", "completion"), _lm_render),
    "text": Task("text", "lm", ("text",), _one_row_of_text, render_rows=_text_rows),
}

TASK_NAMES: tuple[str, ...] = (*_BUILTINS, "custom")


def _placeholders(template: str) -> tuple[str, ...]:
    """The ``{field}`` names of a custom template, in order of first use; ``UsageError`` for anything else."""
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise UsageError("template", f"bad braces ({exc}); write {{{{ and }}}} for literal braces") from None
    names: list[str] = []
    for _, name, spec, conversion in parts:
        if name is None:
            continue
        if not name.isidentifier() or spec or conversion:
            raise UsageError("template", f"placeholder {{{name}}} must be a plain field name such as {{text}}")
        if name == "label":
            raise UsageError("template", "the template must not show the label it is asked to predict")
        if name not in names:
            names.append(name)
    if not names:
        raise UsageError("template", "has no {field} placeholder, so every example would read the same")
    return tuple(names)


def _verbalizer_index(verbalizer: Any) -> dict[str, int]:
    """Label value → candidate index for a custom verbalizer (its order is the candidates' order)."""
    if not isinstance(verbalizer, Mapping) or len(verbalizer) < 2:
        raise UsageError("verbalizer", 'needs an object with at least two labels, e.g. {"0": " no", "1": " yes"}')
    for key, text in verbalizer.items():
        if not isinstance(key, str) or not isinstance(text, str) or not text:
            raise UsageError("verbalizer", f"label {key!r} must map to a non-empty string, got {text!r}")
    if len(set(verbalizer.values())) < len(verbalizer):
        raise UsageError("verbalizer", "two labels share the same answer text, so they cannot be told apart")
    return {key: i for i, key in enumerate(verbalizer)}


def _custom(template: str, verbalizer: Mapping[str, str]) -> Task:
    names = _placeholders(template)
    index = _verbalizer_index(verbalizer)
    candidates = list(verbalizer.values())

    def render(record: Mapping[str, Any]) -> Rendered:
        prompt = template.format_map({name: _text(record, name) for name in names})
        return Rendered(prompt, list(candidates), _label_index(record, index))

    return Task("custom", "classification", (*names, "label"), render, tuple(index))


def _reworded(task: Task, template: str, verbalizer: Mapping[str, str]) -> Task:
    """A built-in classification task read through another prompt: the template may use the task's fields only,
    and the verbalizer gives one answer per answer of the task, keyed by one of its label spellings (every spelling
    the task accepts still reads)."""
    names = _placeholders(template)
    unknown = [n for n in names if n not in task.fields or n == "label"]
    if unknown:
        fields = ", ".join(f"{{{f}}}" for f in task.fields if f != "label")
        raise UsageError("template", f"{task.name} records have no field {unknown[0]!r}; use {fields}")
    _verbalizer_index(verbalizer)
    order = []
    for spellings in task.classes:
        keys = [key for key in verbalizer if key in spellings]
        if len(keys) != 1:
            raise UsageError(
                "verbalizer",
                f"{task.name} needs one answer for each label ({' / '.join(s[0] for s in task.classes)}), "
                f"keyed by one of its spellings; got {', '.join(map(repr, verbalizer))}",
            )
        order.append(keys[0])
    if len(verbalizer) != len(order):
        raise UsageError("verbalizer", f"{task.name} has {len(order)} labels, got {len(verbalizer)} answers")
    candidates = [verbalizer[key] for key in order]
    index = {spelling: i for i, spellings in enumerate(task.classes) for spelling in spellings}

    def render(record: Mapping[str, Any]) -> Rendered:
        prompt = template.format_map({name: _text(record, name) for name in names})
        return Rendered(prompt, list(candidates), _label_index(record, index))

    return replace(task, render_record=render)


def get_task(name: str, template: str | None = None, verbalizer: Mapping[str, str] | None = None) -> Task:
    """The task called ``name``; ``custom`` is built from a template with ``{field}`` placeholders and a
    verbalizer mapping label values (as strings) to answer texts. A built-in classification task takes another
    prompt the same way (its own fields, one answer per label): the same records and labels, read differently
    (``shared.prompts`` chooses one per model). ``UsageError`` names the bad argument."""
    if name == "custom":
        if template is None:
            raise UsageError("template", "is required with --task custom")
        if verbalizer is None:
            raise UsageError("verbalizer", "is required with --task custom")
        return _custom(template, verbalizer)
    if name not in _BUILTINS:
        raise UsageError("task", f"unknown task {name!r}; choose from {', '.join(TASK_NAMES)}")
    task = _BUILTINS[name]
    if template is None and verbalizer is None:
        return task
    if not task.classes:
        field_name = "template" if template is not None else "verbalizer"
        raise UsageError(field_name, f"only applies to --task custom and the classification tasks, not {name}")
    if template is None or verbalizer is None:
        missing = "template" if template is None else "verbalizer"
        raise UsageError(missing, f"another prompt for {name} needs both --template and --verbalizer")
    return _reworded(task, template, verbalizer)


_CHAT_SLOT = "\x00{prompt}\x00"  # stands for the user's message while a chat template is rendered


def chat_frame(tokenizer: Any) -> tuple[str, str]:
    """The text an instruct model's chat template puts before and after ONE user message, the assistant's cue
    included: ``prefix + prompt + suffix`` is the prompt as the model was tuned to read it.

    Rendered once with a placeholder message, so a program or a device needs only these two strings (no Jinja,
    no ``transformers``); ``UsageError`` on ``--chat-template`` when the tokenizer has no template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError("chat_template", "the model's tokenizer has no chat template")
    message = [{"role": "user", "content": _CHAT_SLOT}]
    text = tokenizer.apply_chat_template(message, tokenize=False, add_generation_prompt=True)
    prefix, found, suffix = text.partition(_CHAT_SLOT)
    if not found:
        raise UsageError("chat_template", "the model's chat template does not show the user's message verbatim")
    return prefix, suffix


def with_chat(task: Task, frame: tuple[str, str] | list[str] | None) -> Task:
    """``task`` with every prompt inside a chat frame (``chat_frame``); None leaves it as it is.

    Answers lose their leading spaces: the assistant's turn starts on a new line, where no word-separating space
    comes first (the rule of this module: no space after a newline).
    """
    if frame is None:
        return task
    prefix, suffix = frame

    def framed(plain: Rendered) -> Rendered:
        return Rendered(prefix + plain.prompt + suffix, [c.lstrip(" ") for c in plain.candidates], plain.label)

    def render(record: Mapping[str, Any]) -> Rendered:
        return framed(task.render_record(record))

    rows = None if task.render_rows is None else (lambda record: [framed(r) for r in task.render_rows(record)])
    return replace(task, render_record=render, render_rows=rows)


# The prompt flags' help, shared by the commands that take them (train, eval, export, jobs submit)
TEMPLATE_HELP = (
    'prompt with {field} placeholders: a custom task\'s (e.g. "{text} It was"), or another prompt for a built-in '
    "classification task over its own fields (with --verbalizer)"
)
VERBALIZER_HELP = 'label → answer text, JSON: e.g. {"0": " terrible", "1": " great"}'
BUILTIN_HELP = (
    "a built-in task without --template: model (default), read it through the prompt chosen for the model where it "
    "has one (the model folder's mobizo_prompts.json, `mobizo prompts search --write-model`); builtin, the task's own"
)

BUCKET_HELP = (
    "batches per length bucket: each window of B batches is sorted by length and dealt out, so a batch pads little "
    "(a program runs it at its longest row); 1: batches as the epoch's shuffle draws them; a private run draws its own"
)
CALIBRATE_HELP = (
    "classification: divide the prompt's prior, measured on content-free inputs (N/A, empty, [MASK]) with the base "
    "model, out of the answers' scores before predicting (contextual calibration)"
)


def parse_verbalizer(text: str | None) -> dict[str, str] | None:
    """The ``--verbalizer`` JSON text as an object (None stays None); ``get_task`` checks its shape."""
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError("verbalizer", f"not valid JSON ({exc.msg})") from None


def placeholder_record(task: Task) -> dict[str, Any]:
    """A record that renders: every text field "x" (dotted paths nested) and the first accepted label (what
    ``shared.data.answer_len_for`` measures a task's answers on)."""
    record: dict[str, Any] = {"label": task.labels[0]}
    for path in task.fields:
        *parents, leaf = path.split(".")
        node = record
        for key in parents:
            node = node.setdefault(key, {})
        node.setdefault(leaf, "x")
    return record


TASK_DATA_ENV = "MOBIZO_TASK_DATA_DIR"
SAMPLES_DIR = Path(__file__).resolve().parents[1] / "data"


def task_data_dir() -> Path:
    """Where the task data lives: ``$MOBIZO_TASK_DATA_DIR`` if set, else ``SAMPLES_DIR``, the small samples the
    repository ships in ``data/`` (``data/README.md``), which the demo, the tiny tokenizer and the tests run on.

    The samples are found next to this package's source, i.e. in a checkout or an editable install; an installed
    copy of ``shared`` (``pip install .``) does not carry them, so name a data folder there. Not ``MOBIZO_DATA_DIR``:
    that is the server's artifact folder."""
    named = os.environ.get(TASK_DATA_ENV)
    return Path(named) if named else SAMPLES_DIR
