"""Task templates on real benchmark records, label mappings, and clear errors for custom tasks."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from shared.data import load_examples
from shared.errors import DataError, UsageError
from shared.tasks import (
    TASK_NAMES,
    TEXT_PIECE_CHARS,
    Rendered,
    get_task,
    parse_verbalizer,
    task_data_dir,
    text_pieces,
    with_chat,
)

DATA = task_data_dir()
FILES = {
    "sst2": ["sst2/train.jsonl", "sst2/validation.jsonl"],
    "rte": ["rte/train.jsonl", "rte/validation.jsonl"],
    "wnli": ["wnli/train.jsonl", "wnli/validation.jsonl"],
    **{
        name: [f"superglue/{name}/{split}.jsonl" for split in ("train32", "dev32", "validation")]
        for name in ("boolq", "wic", "wsc", "cb", "copa")
    },
}


def first_record(path: str, line: int = 0) -> dict:
    with open(DATA / path, encoding="utf-8") as handle:
        for _ in range(line):
            handle.readline()
        return json.loads(handle.readline())


# The first records of the data files, rendered by hand from the README's label conventions.
EXPECTED = [
    ("sst2", "sst2/train.jsonl", 0, "hide new secretions from the parental units It was", " terrible"),
    (
        "rte",
        "rte/train.jsonl",
        0,
        'No Weapons of Mass Destruction Found in Iraq Yet.\nDoes this mean that "Weapons of Mass Destruction Found '
        'in Iraq." is true? Yes or No?\n',
        "No",  # GLUE label 1 = not_entailment
    ),
    (
        "wnli",
        "wnli/train.jsonl",
        0,
        "John couldn't see the stage with Billy in front of him because he is so short.\nDoes this mean that "
        '"John is so short." is true? Yes or No?\n',
        "Yes",  # WNLI label 1 = entailment
    ),
    (
        "wic",
        "superglue/wic/train32.jsonl",
        0,
        'Does the word "feel" have the same meaning in these two sentences? Yes, No?\nYou make me feel naked.\n'
        "She felt small and insignificant.\n",
        "Yes",
    ),
    (
        "wsc",
        "superglue/wsc/train32.jsonl",
        0,
        "The actress used to be named Terpsichore , but she changed it to Tina a few years ago, because she figured "
        'it was easier to pronounce.\nIn the previous sentence, does the pronoun "it" refer to Tina? Yes or No?\n',
        "Yes",
    ),
    (
        "copa",
        "superglue/copa/train32.jsonl",
        0,
        "The chandelier shattered on the floor because",
        " the chandelier dropped from the ceiling.",
    ),
    (
        "copa",
        "superglue/copa/train32.jsonl",
        1,
        "The man slid the razor across his chin so",
        " his stubble disappeared.",
    ),
]


@pytest.mark.parametrize(("name", "path", "line", "prompt", "answer"), EXPECTED)
def test_first_records_render_as_the_paper_templates(name: str, path: str, line: int, prompt: str, answer: str) -> None:
    rendered = get_task(name).render(first_record(path, line))
    assert rendered.prompt == prompt
    assert rendered.candidates[rendered.label] == answer


def test_boolq_question_is_capitalized_with_a_question_mark() -> None:
    record = first_record("superglue/boolq/train32.jsonl")
    rendered = get_task("boolq").render(record)
    assert rendered.prompt == record["passage"] + " Is ghost in the shell based on the anime?"
    assert rendered.candidates == [" No", " Yes"] and rendered.label == 0  # label false


def test_cb_maps_its_three_labels() -> None:
    task = get_task("cb")
    answers = {}
    for line in range(3):
        record = first_record("superglue/cb/validation.jsonl", line)
        rendered = task.render(record)
        answers[record["label"]] = rendered.candidates[rendered.label]
        assert rendered.prompt.startswith(f"Suppose {record['premise']} Can we infer that")
    assert answers == {"contradiction": "No", "neutral": "Maybe", "entailment": "Yes"}


@pytest.mark.parametrize("name", list(FILES))
def test_every_file_loads_and_labels_keep_their_balance(name: str) -> None:
    """Whole files render; each raw label value maps to one candidate, the same every time."""
    task = get_task(name)
    for path in FILES[name]:
        rendered = load_examples(task, DATA / path)
        with open(DATA / path, encoding="utf-8") as handle:
            raw = [json.dumps(json.loads(line)["label"]) for line in handle]
        pairs = Counter(zip(raw, (r.label for r in rendered), strict=True))
        assert len(pairs) == len(set(raw)) == len(set(r.label for r in rendered))  # a bijection
        assert all(0 <= r.label < len(r.candidates) for r in rendered)


@pytest.mark.parametrize(
    ("name", "candidates"),
    [
        ("sst2", [" terrible", " great"]),
        ("boolq", [" No", " Yes"]),
        ("rte", ["Yes", "No"]),
        ("wnli", ["No", "Yes"]),
        ("wic", ["No", "Yes"]),
        ("wsc", ["No", "Yes"]),
        ("cb", ["Yes", "No", "Maybe"]),
    ],
)
def test_verbalizers_space_exactly_when_the_prompt_leaves_it(name: str, candidates: list[str]) -> None:
    rendered = get_task(name).render(first_record(FILES[name][0]))
    assert rendered.candidates == candidates
    assert rendered.prompt.endswith("\n") != candidates[0].startswith(" ")


def test_task_kinds_and_names() -> None:
    assert set(TASK_NAMES) == {"sst2", "rte", "wnli", "boolq", "wic", "wsc", "cb", "copa", "custom", "lm", "text"}
    assert get_task("copa").kind == "multiple_choice"
    assert get_task("lm").kind == "lm"
    assert get_task("sst2").kind == "classification"
    assert get_task("wsc").fields == ("text", "target.span1_text", "target.span2_text", "label")


def test_builtin_tasks_accept_integer_label_ids() -> None:
    """The Hugging Face copies of SuperGLUE use 0/1/2 where the FewGLUE files spell the labels."""
    record = {"premise": "p.", "hypothesis": "h", "label": 2}
    assert get_task("cb").render(record).label == get_task("cb").render({**record, "label": "neutral"}).label == 2
    assert get_task("boolq").render({"passage": "p", "question": "q", "label": 1}).label == 1


@pytest.mark.parametrize(
    ("name", "record", "message"),
    [
        ("wsc", {"text": "t", "target": {"span2_text": "it"}, "label": True}, "missing field 'target.span1_text'"),
        ("rte", {"premise": "p", "hypothesis": "h", "label": "yes"}, "field 'label': 'yes' is not one of"),
        ("boolq", {"passage": "p", "question": "q", "label": 0.5}, "field 'label': 0.5"),
        ("copa", {"premise": "p", "choice1": "a", "choice2": "b", "question": "why", "label": 0}, "'question'"),
        ("lm", {"prompt": "p", "completion": ""}, "field 'completion' is empty"),
        ("sst2", {"sentence": ["a"], "label": 0}, "field 'sentence' must be a string"),
    ],
)
def test_records_that_do_not_fit_name_the_field(name: str, record: dict, message: str) -> None:
    with pytest.raises(DataError, match=message):
        get_task(name).render(record)


def test_copa_keeps_the_capital_of_i() -> None:
    record = {"premise": "I was hungry.", "choice1": "I ate.", "choice2": "The dog barked.", "question": "effect"}
    record["label"] = 0
    assert get_task("copa").render(record) == Rendered("I was hungry so", [" I ate.", " the dog barked."], 0)


def test_lm_task_scores_the_completion() -> None:
    rendered = get_task("lm").render({"prompt": "Dear Ann,", "completion": " thanks for the tea."})
    assert rendered == Rendered("Dear Ann,", [" thanks for the tea."], 0)


# --- the user's own text --------------------------------------------------------------------------------------


def test_a_text_record_is_a_row_per_line_each_given_the_context_and_the_lines_before() -> None:
    record = {"context": "Speak, speak.", "text": "You are all resolved\nrather to die?"}
    assert get_task("text").rows(record) == [
        Rendered("Speak, speak.\n\n", ["You are all resolved\n"], 0),
        Rendered("Speak, speak.\n\nYou are all resolved\n", ["rather to die?\n"], 0),
    ]
    assert get_task("text").kind == "lm" and get_task("lm").rows({"prompt": "a", "completion": "b"}) == [
        Rendered("a", ["b"], 0)
    ]


@pytest.mark.parametrize("context", [None, "", "absent"])
def test_a_text_without_context_follows_a_blank_line(context: str | None) -> None:
    record = {"text": "Hello there"} if context == "absent" else {"text": "Hello there", "context": context}
    assert get_task("text").rows(record) == [Rendered("\n\n", ["Hello there\n"], 0)]


@pytest.mark.parametrize(
    "text",
    [
        "one line",
        "two\nlines\n",
        "a paragraph\n\nand another\n\n\n",
        "\nstarts with a break",
        "a long line " * 20,
        "x" * 150 + " tail",
        "é" * 70 + "\r\nwindows",
    ],
)
def test_the_pieces_are_the_text_and_each_fits(text: str) -> None:
    pieces = text_pieces(text)
    assert "".join(pieces) == (text if text.endswith("\n") else text + "\n")
    assert all(len(p.rstrip("\n")) <= TEXT_PIECE_CHARS for p in pieces)
    assert all(p.strip("\n") or i == 0 for i, p in enumerate(pieces))  # only a leading break stands alone
    rows = get_task("text").rows({"text": text})
    assert [r.candidates[0] for r in rows] == pieces
    assert [r.prompt for r in rows] == ["\n\n" + "".join(pieces[:i]) for i in range(len(pieces))]


def test_a_long_line_is_cut_before_a_space() -> None:
    line = "word " * 30
    pieces = text_pieces(line.strip(), max_chars=12)
    assert pieces[:2] == ["word word", " word word"]  # the space starts the next piece, as a BPE token does


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"text": " \n "}, "field 'text' is empty"),
        ({"context": "c"}, "missing field 'text'"),
        ({"text": "t", "context": ["c"]}, "field 'context' must be a string"),
    ],
)
def test_a_text_record_that_does_not_fit_names_the_field(record: dict, message: str) -> None:
    with pytest.raises(DataError, match=message):
        get_task("text").rows(record)


def test_a_chat_frame_frames_every_row_of_a_text() -> None:
    rows = with_chat(get_task("text"), ("<u>", "</u>")).rows({"text": "a\nb"})
    assert [(r.prompt, r.candidates) for r in rows] == [("<u>\n\n</u>", ["a\n"]), ("<u>\n\na\n</u>", ["b\n"])]


# --- custom tasks ----------------------------------------------------------------------------------------------

VERBALIZER = {"0": " terrible", "1": " great"}


def test_custom_task_renders_its_template() -> None:
    task = get_task("custom", "Review: {text} ({stars} stars) It was", VERBALIZER)
    assert task.fields == ("text", "stars", "label") and task.kind == "classification"
    rendered = task.render({"text": "Fine {food}", "stars": 4, "label": 1})
    assert rendered == Rendered("Review: Fine {food} (4 stars) It was", [" terrible", " great"], 1)


def test_custom_task_reads_booleans_as_true_false() -> None:
    task = get_task("custom", "{q}", {"false": " no", "true": " yes"})
    assert task.render({"q": "x", "label": True}).label == 1
    with pytest.raises(DataError, match="field 'label': 1 is not one of false, true"):
        task.render({"q": "x", "label": 1})


@pytest.mark.parametrize(
    ("template", "verbalizer", "argument", "reason"),
    [
        ("{text It was", VERBALIZER, "--template", "bad braces"),
        ("{text}} It was", VERBALIZER, "--template", "bad braces"),
        ("{} It was", VERBALIZER, "--template", "plain field name"),
        ("{0} It was", VERBALIZER, "--template", "plain field name"),
        ("{text!r} It was", VERBALIZER, "--template", "plain field name"),
        ("{text:>9} It was", VERBALIZER, "--template", "plain field name"),
        ("{doc.title} It was", VERBALIZER, "--template", "plain field name"),
        ("It was", VERBALIZER, "--template", "no {field} placeholder"),
        ("{text} {label}", VERBALIZER, "--template", "must not show the label"),
        ("{text}", {"0": " only"}, "--verbalizer", "at least two labels"),
        ("{text}", [" a", " b"], "--verbalizer", "at least two labels"),
        ("{text}", {"0": " a", "1": ""}, "--verbalizer", "non-empty string"),
        ("{text}", {"0": " a", "1": 2}, "--verbalizer", "non-empty string"),
        ("{text}", {"0": " a", "1": " a"}, "--verbalizer", "same answer text"),
        (None, VERBALIZER, "--template", "required"),
        ("{text}", None, "--verbalizer", "required"),
    ],
)
def test_custom_task_errors_name_the_argument(template, verbalizer, argument: str, reason: str) -> None:
    with pytest.raises(UsageError, match=reason) as info:
        get_task("custom", template, verbalizer)
    assert info.value.argument == argument


def test_custom_task_missing_field_is_a_data_error() -> None:
    with pytest.raises(DataError, match="missing field 'text'"):
        get_task("custom", "{text} It was", VERBALIZER).render({"sentence": "x", "label": 0})


@pytest.mark.parametrize(
    ("name", "template", "verbalizer", "argument"),
    [
        ("mnli", None, None, "--task"),
        ("sst2", "{text}", {"0": " bad", "1": " good"}, "--template"),  # not a field of sst2's records
        ("sst2", "{sentence}", None, "--verbalizer"),  # another prompt needs both
        ("rte", None, VERBALIZER, "--template"),
        ("rte", "{premise}", {"0": " yes", "2": " no"}, "--verbalizer"),  # 2 is no label of rte's
        ("rte", "{premise}", {"0": " yes", "entailment": " sure", "1": " no"}, "--verbalizer"),  # two for one label
        ("lm", "{prompt}", VERBALIZER, "--template"),  # lm and copa keep their own prompts
        ("copa", None, VERBALIZER, "--verbalizer"),
    ],
)
def test_get_task_rejects_unknown_names_and_misplaced_options(name, template, verbalizer, argument: str) -> None:
    with pytest.raises(UsageError) as info:
        get_task(name, template, verbalizer)
    assert info.value.argument == argument


def test_a_builtin_task_read_through_another_prompt_keeps_its_records_and_labels() -> None:
    """Every label spelling the task accepts still reads, and the answers come in the task's label order whatever
    order the verbalizer lists them in."""
    task = get_task("rte", "{premise} / {hypothesis}", {"not_entailment": " no", "0": " yes"})
    assert task.name == "rte" and task.fields == get_task("rte").fields
    for label, right in (("entailment", 0), (0, 0), ("0", 0), ("not_entailment", 1), (1, 1)):
        rendered = task.render({"premise": "p", "hypothesis": "h", "label": label})
        assert rendered == Rendered("p / h", [" yes", " no"], right)
    boolq = get_task("boolq", "{passage}? {question}", {"true": " Yes", "false": " No"})
    assert boolq.render({"passage": "p", "question": "q", "label": True}).label == 1
    assert boolq.render({"passage": "p", "question": "q", "label": "0"}) == Rendered("p? q", [" No", " Yes"], 0)


def test_parse_verbalizer() -> None:
    assert parse_verbalizer('{"0": " no", "1": " yes"}') == {"0": " no", "1": " yes"}
    assert parse_verbalizer(None) is None
    with pytest.raises(UsageError, match="not valid JSON") as info:
        parse_verbalizer("{'0': 'no'}")
    assert info.value.argument == "--verbalizer"


def test_tasks_list_the_labels_they_accept() -> None:
    assert get_task("sst2").labels == ("0", "1")
    assert get_task("cb").labels == ("entailment", "0", "contradiction", "1", "neutral", "2")
    assert get_task("custom", "{t}", {"neg": " bad", "pos": " good"}).labels == ("neg", "pos")
    assert get_task("lm").labels == ()
