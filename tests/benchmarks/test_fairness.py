"""benchmarks/fairness.py, shortened: the server runs in a process of its own, the attacker's forged logs are
replayed and refused (422) or turned away while another is replaying (429), the victim's valid uploads all succeed,
and the table has a row per request kind with a column per phase (here idle and 2 attacking devices)."""

from __future__ import annotations

import re
import sys

import pytest

from benchmarks import fairness


@pytest.mark.slow  # a server and attacker processes: about 20 s
def test_a_short_run_prints_the_side_by_side_table(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    argv = ["fairness", "--rounds", "3", "--attack-steps", "200", "--attackers", "2"]
    monkeypatch.setattr(sys, "argv", argv)
    fairness.main()
    out = capsys.readouterr().out
    answers = re.findall(r"(\d) attacker process\(es\): the attacker's answers \{(.*)\}", out)
    assert [processes for processes, _ in answers] == ["2"]
    assert all("422" in codes for _, codes in answers), out  # forged logs replayed, then refused
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| request")]
    assert [row.split(" | ")[0] for row in rows] == [f"| {kind}" for kind in fairness.REQUESTS]
    assert all(row.count("×") == 2 for row in rows)  # the attacked phase's p50 and p95 ratios
