"""benchmarks/fairness.py, shortened: the server runs in a process of its own, the attacker's forged logs are
replayed and refused (422) or turned away while another is replaying (429), the victim's valid uploads all succeed,
private submits are taken, merged downloads are served within their bound on disk, and the table has a row per
request kind with a column per phase (here idle, 2 attacking devices, 2 submitting threads, merged downloads)."""

from __future__ import annotations

import re
import sys

import pytest

from benchmarks import fairness


@pytest.mark.slow  # a server, attacker processes, a calibration and merges in worker processes: about a minute
def test_a_short_run_prints_the_side_by_side_table(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    argv = ["fairness", "--rounds", "3", "--attack-steps", "200", "--attackers", "2", "--private-threads", "2"]
    monkeypatch.setattr(sys, "argv", argv)
    fairness.main()
    out = capsys.readouterr().out
    answers = re.findall(r"(\d) attacker process\(es\): the attacker's answers \{(.*)\}", out)
    assert [processes for processes, _ in answers] == ["2"]
    assert all("422" in codes for _, codes in answers), out  # forged logs replayed, then refused
    table, loads = out.split("| request |", 1)[1].split("| phase |")
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows] == [f"| {kind}" for kind in fairness.REQUESTS]
    assert all(row.count("×") == 2 * 3 for row in rows)  # each loaded phase's p50 and p95 ratios
    private, merged = (line for line in loads.splitlines() if line.startswith("| ") and "---" not in line[:5])
    assert private.startswith("| private submits (2 threads) | {") and "202" in private, out
    assert merged.startswith("| merged downloads | {") and "200" in merged, out
    largest, bound = map(float, re.search(r"\| ([\d.]+) \(bound ([\d.]+)\)", merged).groups())
    assert 0 < largest <= bound
