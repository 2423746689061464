"""benchmarks/runner_memory.py: the native runner's own peak RSS against the manifest's memory estimate."""

import json
import resource
import subprocess

import numpy as np
import pytest
import torch

from benchmarks import runner_memory
from tests.utils.programs import TINY_Q4


def test_the_runners_own_peak_is_measured_not_the_benchmarks(program_factory, runner_binary, capsys, tmp_path):
    """The runner runs the steps asked for, and its peak is its own: a few MB for the tiny program, far below this
    process's (torch loaded), which a runner forked from here would report (``ru_maxrss`` survives fork and exec)."""
    pte, manifest = program_factory(TINY_Q4)
    batches = runner_memory.write_sst2_batches(pte, 2, tmp_path)
    row = runner_memory.runner_peak(runner_binary, pte, batches, tmp_path)
    assert row["steps"] == 2 and row["memory_mb"] == manifest.memory_mb
    ours = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    assert 0 < row["peak_mb"] < ours / 2, (row, ours)

    assert runner_memory.main(["--programs", str(pte), "--steps", "1", "--runner", str(runner_binary)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 3 and table[2].startswith(f"| {pte.as_posix()} | step | none |")


def test_the_step_is_set_against_the_inference_forward_of_its_rows_on_the_same_runtime(
    program_factory, inference_program, runner_binary, capsys, tmp_path
):
    """The runner's ``forward`` mode runs the inference program as often as asked, in a process of its own: its peak
    is the runner's (far below this process's) and each call has its own time; the table sets the step's peak and
    time over the inference forward's. ``--export-inference DIR`` finds the inference program of the step's shapes
    that an earlier run kept in DIR."""
    pte, _ = program_factory(TINY_Q4)
    inference, _ = inference_program
    batches = runner_memory.write_sst2_batches(pte, 2, tmp_path)
    row = runner_memory.forward_peak(runner_binary, inference, batches, 3, tmp_path)
    ours = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    assert row["steps"] == 3 and row["seconds"] > 0 and 0 < row["peak_mb"] < ours / 2, (row, ours)

    args = ["--programs", str(pte), "--steps", "2", "--repeats", "2", "--runner", str(runner_binary)]
    assert runner_memory.main([*args, "--export-inference", str(inference.parent)]) == 0
    out = capsys.readouterr()
    table = out.out.splitlines()
    assert table[3].startswith(f"| {inference.as_posix()} | inference |") and table[-1].startswith(f"| {pte}")
    assert "exporting" not in out.err  # the kept program, not a new export
    peak_ratio, time_ratio = (float(cell) for cell in table[-1].strip("| ").split(" | ")[1:])
    assert peak_ratio > 0 and time_ratio > 0

    with pytest.raises(SystemExit) as refused:
        runner_memory.main([*args, "--inference", str(inference), "--export-inference", str(inference.parent)])
    assert refused.value.code == 2 and "give one" in capsys.readouterr().err


def test_the_forward_mode_refuses_a_training_step_and_bad_arguments(program_factory, runner_binary):
    """A training program's forward takes floats (lr, eps): the mode says it runs inference forwards, exit 1."""
    pte, manifest = program_factory(TINY_Q4)
    ptd = pte.parent / manifest.ptd.file
    done = subprocess.run(
        [str(runner_binary), "forward", "--program", str(pte), "--data", str(ptd), "--iterations", "1"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and "not an int64 tensor" in done.stderr, done.stderr
    for bad, message in ((["--iterations", "0"], "at least 1"), (["--iterations", "x"], "not a count")):
        args = [str(runner_binary), "forward", "--program", str(pte), "--data", str(ptd), *bad]
        done = subprocess.run(args, capture_output=True, text=True)
        assert done.returncode == 2 and message in done.stderr, done.stderr


def test_the_forward_mode_runs_the_step_rows_of_a_batches_file(
    program_factory, inference_program, runner_binary, tmp_path
):
    """With ``--batches`` call k runs step k's rows (cycling), each row twice to fill the inference program's 2·rows:
    the per-row losses it prints are the Python runtime's forward of those rows, bit for bit, and differ from step
    to step (real rows, not ones). A program of other widths is refused, naming the input."""
    from executorch.runtime import Runtime

    from device_agent.batches import BatchesFile, Shape, StepBatch, write_batches

    pte, _ = program_factory(TINY_Q4)
    inference, ptd = inference_program
    batches = runner_memory.write_sst2_batches(pte, 2, tmp_path)
    args = [str(runner_binary), "forward", "--program", str(inference), "--data", str(ptd), "--iterations", "3"]
    done = subprocess.run([*args, "--batches", str(batches)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    printed = [json.loads(line)["output"] for line in done.stdout.splitlines()]
    forward = Runtime.get().load_program(inference, data_path=ptd).load_method("forward")
    steps = BatchesFile(batches)
    for k, losses in enumerate(printed):
        step = steps[k % 2]
        rows = [torch.from_numpy(np.concatenate([x, x])) for x in (step.input_ids, step.attention_mask, step.targets)]
        expected = forward.execute(rows)[0]
        assert torch.equal(torch.tensor(losses, dtype=torch.float32), expected), (k, losses, expected)
    assert printed[0] == printed[2] and printed[0] != printed[1]

    other, cells = tmp_path / "other.mzb", np.zeros((8, 12), dtype=np.int64)
    write_batches(other, Shape(8, 12, 1), [StepBatch(0, 0.5, cells, cells + 1, cells[:, :1])])
    done = subprocess.run([*args, "--batches", str(other)], capture_output=True, text=True)
    assert done.returncode == 2 and "forward input 0 is not [k * 8, 12]" in done.stderr, done.stderr
