"""The per-user split (benchmarks/personal_data.py): deterministic, each user's later speeches held out, and the
device's own split of the data it is given holds out exactly those."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.personal_data import corpus_path, main, parse_speeches, split, user_names, user_records
from device_agent.local_data import split_held_out
from shared.data import load_records_rows
from shared.errors import DataError
from shared.tasks import get_task

# The shipped sample: the first 3,000 lines of the corpus (data/README.md), three users at 8,000 characters.
USERS = ["CORIOLANUS", "MARCIUS", "MENENIUS"]


def test_the_sample_has_three_users_whose_last_fifth_is_held_out() -> None:
    users = split()
    assert [u.name for u in users] == USERS
    speeches = parse_speeches(corpus_path().read_text())
    for user in users:
        own = [s for s in speeches if s.speaker == user.name]
        assert [r["text"] for r in user.records] == [s.text for s in own]  # every speech, in the file's order
        assert len(user.held_out) == len(own) // 5 > 0
        assert len(user.lines) == len(own) and list(user.lines) == sorted(user.lines)
        trained_at, held_at = user.lines[: len(user.train)], user.lines[len(user.train) :]
        assert max(trained_at) < min(held_at)  # the held-out speeches are the user's later text, none in training
        assert {r["text"] for r in user.held_out} == {s.text for s in own[len(own) - len(own) // 5 :]}
        assert sum(len(r["text"]) for r in user.records) >= 8000


def test_a_cue_is_the_nearest_earlier_speech_by_another_speaker() -> None:
    text = "A:\nhello\n\nB:\nhi\n\nA:\nhow are you\n\nA:\nwell?\n\nC:\n\nB:\nfine"
    speeches = parse_speeches(text)
    assert [(s.speaker, s.line) for s in speeches] == [("A", 1), ("B", 4), ("A", 7), ("A", 10), ("B", 15)]
    assert [r["context"] for r in user_records(speeches, "A")[0]] == ["", "hi", "hi"]
    assert [r["context"] for r in user_records(speeches, "B")[0]] == ["hello", "well?"]  # C: said nothing
    assert user_names(speeches, min_chars=10) == ["A"]


def test_the_split_is_deterministic_and_the_draw_is_seeded() -> None:
    assert split() == split()
    drawn = {tuple(u.name for u in split(count=2, seed=seed)) for seed in range(20)}
    assert split(count=2, seed=3) == split(count=2, seed=3)
    assert len(drawn) > 1 and all(len(names) == 2 and set(names) <= set(USERS) for names in drawn)
    with pytest.raises(DataError, match="3 speakers have 8000 characters; cannot draw 4 users"):
        split(count=4)


def test_a_device_holds_out_exactly_the_split_s_held_out_speeches(tmp_path: Path, capsys) -> None:
    """The device folders the command writes: the agent's own split of a job's data (its last records, as many as
    ``eval_examples`` asks and at most a fifth) trains on no row of a held-out speech."""
    main(["--out", str(tmp_path)])
    assert "| MENENIUS | 75 | 11,274 | 15 |" in capsys.readouterr().out
    task = get_task("text")
    for user in split():
        records = load_records_rows(task, tmp_path / user.slug / "text" / "train.jsonl")
        trained, held = split_held_out(records, 10_000)  # a job's eval_examples at least a fifth of the texts
        assert held == load_records_rows(task, tmp_path / user.slug / "held_out.jsonl")
        assert held == [task.rows(r) for r in user.held_out] and trained == [task.rows(r) for r in user.train]


def test_a_corpus_block_without_a_name_is_an_error_naming_its_line(tmp_path: Path) -> None:
    path = tmp_path / "input.txt"
    path.write_text("A:\nhello\n\nno name here\n")
    with pytest.raises(DataError, match="input.txt: line 4: expected a 'NAME:' line"):
        split(path)
