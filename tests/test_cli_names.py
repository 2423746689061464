"""One name for one thing: every command that cuts prompts or fixes a program's width takes ``--seq-len``."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from mobizo.cli import build_parser

REPO = Path(__file__).resolve().parents[1]


def _subparser(parser: argparse.ArgumentParser, *names: str) -> argparse.ArgumentParser:
    for name in names:
        (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = action.choices[name]
    return parser


def _option(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    (action,) = [a for a in parser._actions if flag in a.option_strings]
    return action


@pytest.mark.parametrize(
    ("command", "meaning"),
    [
        (("train",), "maximum"),
        (("eval",), "maximum"),
        (("export",), "fixed width"),
        (("jobs", "submit"), "fixed width"),
    ],
)
def test_seq_len_is_the_name_and_its_help_says_what_it_bounds(command: tuple[str, ...], meaning: str) -> None:
    option = _option(_subparser(build_parser(), *command), "--seq-len")
    assert option.dest == "seq_len" and meaning in option.help


def test_eval_keeps_max_len_as_a_hidden_alias() -> None:
    eval_parser = _subparser(build_parser(), "eval")
    assert _option(eval_parser, "--max-len").help == argparse.SUPPRESS
    base = ["--model", "m", "--task", "sst2", "--data", "d"]
    assert eval_parser.parse_args([*base, "--max-len", "48"]).seq_len == 48
    assert eval_parser.parse_args([*base, "--seq-len", "48"]).seq_len == 48


def test_run_program_takes_its_width_from_the_program() -> None:
    run_program = _subparser(build_parser(), "run-program")
    assert not [a for a in run_program._actions if {"--seq-len", "--max-len"} & set(a.option_strings)]


@pytest.mark.parametrize("script", ["step_time.py", "program.py", "agent.py"])
def test_benchmarks_take_seq_len(script: str) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), "--help"], capture_output=True, text=True, check=True
    )
    assert "--seq-len" in done.stdout and "--max-len" not in done.stdout
