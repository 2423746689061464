"""benchmarks/runner_memory.py: the native runner's own peak RSS against the manifest's memory estimate."""

import resource

from benchmarks import runner_memory
from tests.utils.programs import TINY_Q4


def test_the_runners_own_peak_is_measured_not_the_benchmarks(program_factory, runner_binary, capsys):
    """The runner runs the steps asked for, and its peak is its own: a few MB for the tiny program, far below this
    process's (torch loaded), which a runner forked from here would report (``ru_maxrss`` survives fork and exec)."""
    pte, manifest = program_factory(TINY_Q4)
    row = runner_memory.runner_peak(runner_binary, pte, steps=2)
    assert row["steps"] == 2 and row["memory_mb"] == manifest.memory_mb
    ours = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    assert 0 < row["peak_mb"] < ours / 2, (row, ours)

    assert runner_memory.main(["--programs", str(pte), "--steps", "1", "--runner", str(runner_binary)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 3 and table[2].startswith(f"| {pte.as_posix()} | none |")
