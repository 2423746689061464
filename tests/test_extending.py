"""docs/extending.md, the page of where to change what, against the tree and against the project's history: each
table's files exist and hold the names its rows cite, and each table names every file that a real change of its kind
touched (``REAL_CHANGES``: commits of the history, with the files each touched, checked against git where the
history is at hand)."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "extending.md"
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
FIRST_FILES = 5  # the page's "read these first" list


@dataclass(frozen=True)
class RealChange:
    """A commit of the project that made a change of one kind, and the files it touched (``git show --name-only``)
    less ``outside_the_page``. ``by_name``: a touched file that a next change of the kind leaves alone, because it
    reads what changed by a name (a list of ``shared/backends.py``, a function, a column), → that name."""

    commit: str
    touched: tuple[str, ...]
    by_name: dict[str, str] = field(default_factory=dict)


# One real change per table of the page (its heading without "## "), kept here so that a clone without the history
# still checks the page against them.
REAL_CHANGES: dict[str, RealChange] = {
    "A built-in task": RealChange(  # per-user text as a task: a task of a new kind (``text``)
        "d95df744a1da54edc184c3420236c9bbd7dcf50e",
        (
            "data/shakespeare/input.txt",
            "device_agent/evaluation.py",
            "device_agent/job.py",
            "shared/commands/eval.py",
            "shared/data.py",
            "shared/evaluate.py",
            "shared/schemas.py",
            "shared/tasks.py",
        ),
    ),
    "An objective (what a step's loss measures)": RealChange(  # the classification objective
        "873670a0e7fb7982c04c37f7c60ed365cf85581f",
        (
            "device_agent/commands/run_program.py",
            "device_agent/evaluation.py",
            "device_agent/job.py",
            "device_agent/local_data.py",
            "server/commands/jobs.py",
            "server/compile.py",
            "shared/backends.py",
            "shared/batch.py",
            "shared/commands/eval.py",
            "shared/commands/export.py",
            "shared/commands/train.py",
            "shared/data.py",
            "shared/evaluate.py",
            "shared/manifest.py",
            "shared/program.py",
            "shared/schemas.py",
            "shared/train.py",
            "shared/zo.py",
        ),
        by_name={
            "server/commands/jobs.py": "OBJECTIVES",
            "server/compile.py": "resolve_program",
            "shared/commands/eval.py": "OBJECTIVES",
            "shared/commands/export.py": "OBJECTIVES",
            "shared/commands/train.py": "OBJECTIVES",
            "shared/schemas.py": "Objective",
        },
    ),
    "An optimizer (how g moves B)": RealChange(  # momentum and normalized beside sgd
        "bc81cd83d145ab93fe7fcf69ebd6efa3cd865a23",
        (
            "shared/backends.py",
            "shared/checkpoint.py",
            "shared/commands/replay.py",
            "shared/commands/train.py",
            "shared/replay.py",
            "shared/train.py",
            "shared/zo.py",
            "shared/zo_optim.py",
        ),
        by_name={
            "shared/commands/replay.py": "OPTIMIZERS",
            "shared/commands/train.py": "OPTIMIZERS",
            "shared/zo.py": "shared.zo_optim",
        },
    ),
    "A check of uploads": RealChange(  # a private job's log line holds its five fields and nothing else
        "2eb98f285113648939923d4d164dcbf24b99009b",
        ("server/verify.py", "shared/schemas.py", "shared/train_log.py"),
    ),
    "A route": RealChange(  # the work exchange's routes (/v1/work/{work}/...)
        "dab97a6cbed2643d93aed86c91f3dc86ec2475d3",
        (
            "device_agent/api.py",
            "device_agent/job.py",
            "server/app.py",
            "server/deps.py",
            "server/limits.py",
            "server/metrics.py",
            "server/responses.py",
            "server/results.py",
            "server/router.py",
            "server/routes/blobs.py",
            "server/routes/leases.py",
            "server/routes/rounds.py",
            "server/routes/work.py",
            "server/uploads.py",
            "shared/schemas.py",
        ),
    ),
    "A device backend": RealChange(  # native: the runner on this machine, beside adb's phone
        "46901c996ae81de3fa3bb76702db447fa46e7a20",
        (
            "device_agent/adb_standin/adb",
            "device_agent/backends/__init__.py",
            "device_agent/backends/adb.py",
            "device_agent/backends/local.py",
            "device_agent/backends/make.py",
            "device_agent/backends/runner.py",
            "device_agent/backends/transports.py",
            "device_agent/commands/agent.py",
            "device_agent/commands/local_inference.py",
            "device_agent/daemon.py",
            "device_agent/eligibility.py",
            "device_agent/runner/CMakeLists.txt",
            "device_agent/runner/build.sh",
            "device_agent/runner/bundle.sh",
            "device_agent/runner_path.py",
            "server/verify.py",
            "shared/backends.py",
        ),
        by_name={"device_agent/daemon.py": "ctx.backend"},
    ),
    "A table or a column": RealChange(  # server_keys, a table
        "6e548cf16ae852b84f98a2cb1ab238592230bfac",
        (
            "server/accounts.py",
            "server/app.py",
            "server/dashboard/web.py",
            "server/migrations/versions/0015_server_keys.py",
            "server/queries.py",
            "server/tables.py",
        ),
        by_name={"server/app.py": "server_key", "server/dashboard/web.py": "server_key"},
    ),
}


def outside_the_page(path: str) -> bool:
    """What the page leaves to others: the tests (each table's last row names them), the benchmarks (one question
    per script, each with its own page), the documentation and the site's configuration."""
    return path.startswith(("tests/", "benchmarks/")) or path.endswith(".md") or path == "mkdocs.yml"


def tables() -> dict[str, list[list[str]]]:
    """Each table of the page under its heading → its rows, each row's cells (the header and rule left out)."""
    found: dict[str, list[list[str]]] = {}
    heading = None
    for line in PAGE.read_text().splitlines():
        if line.startswith("## "):
            heading = line[3:].strip()
        elif line.startswith("| ") and not line.startswith(("| Step", "|---")) and heading is not None:
            found.setdefault(heading, []).append([cell.strip() for cell in line.strip("|").split("|")])
    return found


def named_paths(rows: list[list[str]]) -> set[str]:
    """The paths a table names (`path` in backticks, a folder ending in /), in any of its cells."""
    return {token for row in rows for token in re.findall(r"`([^`]+)`", " ".join(row[1:])) if "/" in token}


def named(paths: set[str], path: str) -> bool:
    return path in paths or any(p.endswith("/") and path.startswith(p) for p in paths)


def test_the_page_names_files_that_exist_and_names_they_hold() -> None:
    """Each table row's files exist, and each Python name its row cites (`name` in backticks) is in one of those
    files (a directory: any module under it). A renamed function or a moved module fails here."""
    found = tables()
    assert sum(map(len, found.values())) >= 30, "the page's tables"
    missing = []
    for rows in found.values():
        for row in rows:
            assert len(row) == 3, f"a row of three cells (step, file, what): {row}"
            cited = re.findall(r"`([^`]+)`", " ".join(row[1:]))
            paths = [REPO / token for token in cited if "/" in token]
            missing += [f"{row[1][:60]}: no {p.relative_to(REPO)}" for p in paths if not p.exists()]
            text = "".join(
                f.read_text() for p in paths if p.exists() for f in ([p] if p.is_file() else sorted(p.rglob("*.py")))
            )
            names = [token for token in re.findall(r"`([^`]+)`", row[2]) if IDENTIFIER.fullmatch(token)]
            missing += [f"{row[1][:60]}: {name} in none of its files" for name in names if name not in text]
    assert not missing, "\n".join(missing)


def test_each_table_names_every_file_a_real_change_of_its_kind_touched() -> None:
    """A table misses no file: every file its real change touched is named in it (or under a folder it names),
    unless the file reads what changed by a name it holds (``by_name``), so a next change leaves it alone."""
    found = tables()
    assert set(found) == set(REAL_CHANGES), "each table has its real change, and each real change its table"
    missing = []
    for kind, change in REAL_CHANGES.items():
        paths = named_paths(found[kind])
        for path in change.touched:
            if path in change.by_name:
                name = change.by_name[path]
                if name not in (REPO / path).read_text() or named(paths, path):
                    missing.append(f"{kind}: {path} neither holds {name} nor is it left alone by the page")
            elif not named(paths, path):
                missing.append(f"{kind}: {path}, which {change.commit[:7]} touched, is not on the page")
    assert not missing, "\n".join(missing)


def _history_at_hand() -> bool:
    shallow = subprocess.run(
        ["git", "rev-parse", "--is-shallow-repository"], cwd=REPO, capture_output=True, text=True, check=False
    )
    return shallow.returncode == 0 and shallow.stdout.strip() == "false"


@pytest.mark.skipif(not _history_at_hand(), reason="a clone without the whole history: the commits are not here")
@pytest.mark.parametrize("kind", sorted(REAL_CHANGES))
def test_each_real_change_is_its_commit_as_git_tells_it(kind: str) -> None:
    """The files recorded for a real change are those its commit touched (outside the page's concern)."""
    change = REAL_CHANGES[kind]
    shown = subprocess.run(
        ["git", "show", "--name-only", "--format=", change.commit], cwd=REPO, capture_output=True, text=True, check=True
    )
    touched = sorted(path for path in shown.stdout.split() if not outside_the_page(path))
    assert touched == sorted(change.touched)


def test_the_page_opens_with_five_files_to_read_first_and_the_index_links_it() -> None:
    text = PAGE.read_text()
    first = text.split("## Read these five files first", 1)[1].split("\n## ", 1)[0]
    files = re.findall(r"^\d\. `([^`]+)`", first, re.MULTILINE)
    assert len(files) == FIRST_FILES and all((REPO / f).is_file() for f in files), files
    assert "(extending.md)" in (REPO / "docs" / "index.md").read_text()
