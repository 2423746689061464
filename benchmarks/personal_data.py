"""The per-user split of the Shakespeare corpus: each speaking role is one user, its speeches the user's own text.

The corpus (``shakespeare/input.txt`` of the task data: karpathy/char-rnn's tiny Shakespeare, ``data/README.md``)
is a sequence of speeches, each a ``NAME:`` line, the speech, and a blank line before the next. The split:

- **Users**: the speakers whose speeches hold at least ``--min-chars`` characters (8,000 by default: 44 of the
  309 speakers of the whole corpus). A name is one user wherever it speaks (the file does not mark plays).
- **A user's data**: their speeches in the file's order, each one record of the ``text`` task, the format a
  device holds (docs/contracts.md): ``{"context": the cue, "text": the speech}``, the cue being the nearest earlier
  speech by another speaker ("" before the first).
- **Held out**: the user's last fifth of speeches, their own *later* text (``split_held_out``, the device's rule:
  a job whose ``eval_examples`` is at least that many holds out exactly these records and measures them).
- **Seeded**: ``--users K`` draws K of the users with ``--seed`` (all of them by default); the rest is fixed by
  the file.

    python -m benchmarks.personal_data                        # the users of the shipped sample (data/)
    MOBIZO_TASK_DATA_DIR=DIR python -m benchmarks.personal_data --out runs/personal-data   # a device folder each

``--out DIR`` writes, for each user, ``DIR/<user>/text/train.jsonl`` (every speech: the device's data, which holds
its last fifth out itself) and ``DIR/<user>/held_out.jsonl`` (that fifth, for ``mobizo eval`` and
``mobizo agent eval``).
"""

from __future__ import annotations

import argparse
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from device_agent.local_data import split_held_out
from shared.errors import DataError
from shared.files import atomic_write_bytes
from shared.tasks import task_data_dir

MIN_CHARS = 8000
CORPUS = Path("shakespeare") / "input.txt"  # under the task data folder


@dataclass(frozen=True)
class Speech:
    speaker: str
    text: str
    line: int  # the line of its NAME: in the file, counted from 1


@dataclass(frozen=True)
class User:
    """One user: the records their device trains on (in order) and the later ones it holds out."""

    name: str
    train: tuple[dict, ...]
    held_out: tuple[dict, ...]
    lines: tuple[int, ...]  # where each record's speech starts in the file (training records, then held-out ones)

    @property
    def records(self) -> tuple[dict, ...]:
        """Everything the device holds, in order: the training records, then the held-out ones."""
        return self.train + self.held_out

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-")


def corpus_path() -> Path:
    """The corpus in the task data folder (``shared.tasks.task_data_dir``: the shipped sample by default)."""
    return task_data_dir() / CORPUS


def parse_speeches(text: str) -> list[Speech]:
    """Every speech of the corpus, in order (a ``NAME:`` line with no speech under it is none: the file has 125);
    ``DataError`` naming the line of a block that does not start with a ``NAME:`` line."""
    speeches, line = [], 1
    for block in text.split("\n\n"):
        lines = block.strip("\n").split("\n")
        start = line + len(block) - len(block.lstrip("\n"))
        line += block.count("\n") + 2
        if lines == [""]:
            continue
        if not lines[0].endswith(":") or not lines[0][:-1].strip():
            raise DataError(f"line {start}: expected a 'NAME:' line, got {lines[0][:40]!r}")
        if len(lines) > 1:
            speeches.append(Speech(lines[0][:-1], "\n".join(lines[1:]), start))
    if not speeches:
        raise DataError("no speeches (the file is empty)")
    return speeches


def user_records(speeches: list[Speech], speaker: str) -> tuple[list[dict], list[int]]:
    """``speaker``'s speeches in order as ``text`` records, each with its cue (the nearest earlier speech by
    another speaker), and the line each starts at."""
    records, lines, cue = [], [], ""
    for speech in speeches:
        if speech.speaker == speaker:
            records.append({"context": cue, "text": speech.text})
            lines.append(speech.line)
        else:
            cue = speech.text
    return records, lines


def user_names(speeches: list[Speech], min_chars: int = MIN_CHARS) -> list[str]:
    """The speakers with at least ``min_chars`` characters of speech, by name."""
    chars: dict[str, int] = {}
    for speech in speeches:
        chars[speech.speaker] = chars.get(speech.speaker, 0) + len(speech.text)
    return sorted(name for name, count in chars.items() if count >= min_chars)


def split(path: Path | None = None, min_chars: int = MIN_CHARS, count: int | None = None, seed: int = 0) -> list[User]:
    """The users of the corpus at ``path`` (default ``corpus_path()``), by name: ``count`` of them drawn with
    ``seed`` (None: all), each with the last fifth of their speeches held out."""
    path = path or corpus_path()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        speeches = parse_speeches(text)
    except DataError as exc:
        raise DataError(f"{path}: {exc}") from None
    names = user_names(speeches, min_chars)
    if count is not None:
        if not 1 <= count <= len(names):
            raise DataError(f"{path}: {len(names)} speakers have {min_chars} characters; cannot draw {count} users")
        names = sorted(random.Random(seed).sample(names, count))
    users = []
    for name in names:
        records, lines = user_records(speeches, name)
        train, held_out = split_held_out(records, len(records))
        users.append(User(name, tuple(train), tuple(held_out), tuple(lines)))
    return users


def jsonl(records: tuple[dict, ...] | list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()


def write_devices(users: list[User], out: Path) -> None:
    """Each user's device folder: ``<user>/text/train.jsonl`` (all their records) and ``<user>/held_out.jsonl``."""
    for user in users:
        atomic_write_bytes(out / user.slug / "text" / "train.jsonl", jsonl(user.records))
        atomic_write_bytes(out / user.slug / "held_out.jsonl", jsonl(user.held_out))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", type=Path, help=f"the corpus (default: {CORPUS} of the task data folder)")
    p.add_argument("--min-chars", type=int, default=MIN_CHARS, help="a user's speeches hold at least this many")
    p.add_argument("--users", type=int, help="draw this many users (default: all)")
    p.add_argument("--seed", type=int, default=0, help="the draw's seed")
    p.add_argument("--out", type=Path, help="write a device folder per user here")
    args = p.parse_args(argv)
    try:
        users = split(args.input, args.min_chars, args.users, args.seed)
    except DataError as exc:
        p.error(str(exc))
    print("| user | speeches | characters | held out (speeches) |\n|---|---|---|---|")
    for u in users:
        chars = sum(len(r["text"]) for r in u.records)
        print(f"| {u.name} | {len(u.records)} | {chars:,} | {len(u.held_out)} |")
    if args.out:
        write_devices(users, args.out)
        print(f"device folders in {args.out}")


if __name__ == "__main__":
    main()
