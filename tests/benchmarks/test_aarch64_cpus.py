"""benchmarks/aarch64_cpus.py: the same program on an emulated aarch64 CPU and on this machine."""

import json

import pytest

from benchmarks import aarch64_cpus
from tests.utils.programs import TINY_Q4

pytestmark = pytest.mark.slow  # qemu


def test_an_emulated_cpus_run_replays_and_its_rows_are_compared_with_this_machines(
    program_factory, runner_binary, runner_binary_aarch64, tmp_path, capsys
):
    """Two steps on a cortex-a76: its final B is the replay of its own log, and its row is set against this
    machine's (whose own differences are zero by definition)."""
    pte, _ = program_factory(TINY_Q4)
    out = tmp_path / "rows.json"
    argv = ["--programs", str(pte), "--steps", "2", "--cpu", "cortex-a76", "--json", str(out)]
    assert aarch64_cpus.main([*argv, "--runner-aarch64", str(runner_binary_aarch64)]) == 0
    host, arm = json.loads(out.read_text())
    assert host["cpu"] == "this machine" and host["step0_max_diff"] == 0 and host["b_differ"] == 0
    assert arm["cpu"] == "cortex-a76" and arm["emulator"].startswith("qemu ") and arm["steps"] == 2
    assert host["replays"] and arm["replays"]
    assert arm["step0_max_diff"] < 1e-3  # the same B and rows: only the kernels' summation order differs
    assert "cortex-a76" in capsys.readouterr().out
