"""The native runner against the ExecuTorch Python runtime: same program, same batches, same bits."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from device_agent.backends import TrainRun
from device_agent.backends.make import make_backend
from device_agent.batches import BatchesFile, Shape, fit_width, write_batches
from device_agent.checkpoint import Checkpoint, load_b, load_checkpoint, save_b, save_checkpoint
from shared.replay import replay
from shared.schedule import lr_at
from shared.train_log import log_line, log_record, parse_log
from tests.device_agent.helpers import EPS, Program, as_f32, python_reference, random_steps, run_runner, runner_args
from tests.utils.programs import TINY_Q4

pytestmark = pytest.mark.slow  # the session's program export (about a minute) lands on the first of these

EXIT_STOPPED = 75
EPS32 = float(np.float32(EPS))


def test_runner_matches_python_runtime_bit_for_bit(
    runner_binary: Path, tiny_program: Program, make_batches: Callable[..., Path], tmp_path: Path
) -> None:
    batches = make_batches(6)
    status, lines, stderr = run_runner(runner_args(runner_binary, tiny_program.files, batches, tmp_path / "b.f32"))
    assert status == 0, stderr
    reference, final_b = python_reference(tiny_program, batches)
    assert [line["step"] for line in lines] == list(range(6))
    for line, (losses, g) in zip(lines, reference):
        assert as_f32(line["losses"]).tobytes() == losses.tobytes()
        assert as_f32(line["g"]).tobytes() == g.tobytes()
    assert load_b(tmp_path / "b.f32").tobytes() == final_b.tobytes()
    assert final_b.size == tiny_program.d and np.any(final_b != 0)  # training moved B


def test_runner_runs_the_schedule_in_the_batches_bit_for_bit(
    runner_binary: Path, tiny_program: Program, make_batches: Callable[..., Path], tmp_path: Path
) -> None:
    """Warm-up then cosine decay, one lr per record: the runner, the Python runtime and the replay of the runner's
    log (as the agent writes it and the server checks it) give the same B, bit for bit."""
    lrs = [lr_at(0.05, 6, k, "cosine", warmup_steps=2, lr_floor=0.1) for k in range(6)]
    assert len(set(lrs)) == 5  # all differ but the last warm-up step and the next, both at lr
    batches = make_batches(6, lrs=lrs)
    # Each step at its longest row, as the agent runs it (the executorch backend below, the adb one's --min-width):
    # the same rows at another width are the same sums in another order, equal on some CPUs and not on others.
    widths = tiny_program.manifest.inputs.widths
    assert widths is not None
    width_arg = ("--min-width", str(widths[0]))
    args = runner_args(runner_binary, tiny_program.files, batches, tmp_path / "b.f32", *width_arg)
    status, lines, stderr = run_runner(args)
    assert status == 0, stderr
    assert as_f32([line["lr"] for line in lines]).tolist() == lrs  # %.9g: parsed as float32, the record's value
    reference, final_b = python_reference(tiny_program, batches, widths=widths)
    for line, (losses, g) in zip(lines, reference, strict=True):
        assert as_f32(line["losses"]).tobytes() == losses.tobytes()
        assert as_f32(line["g"]).tobytes() == g.tobytes()
    runner_b = load_b(tmp_path / "b.f32")
    assert runner_b.tobytes() == final_b.tobytes()
    zeros = np.zeros(tiny_program.d, np.float32)
    run = TrainRun("job-s", *tiny_program.files, tiny_program.manifest, batches, EPS32, zeros, tmp_path / "c", 0)
    records: list = []
    outcome = make_backend("executorch").train(run, 0, None, records.append, lambda: False)
    assert [r.lr for r in records] == lrs and outcome.b.tobytes() == runner_b.tobytes()
    log = [
        log_record(k, line["seed"], lrs[k], EPS32, as_f32(line["g"]), as_f32(line["losses"]))
        for k, line in enumerate(lines)
    ]
    replayed = replay(torch.zeros(tiny_program.d), parse_log("".join(map(log_line, log))))
    assert replayed.numpy().tobytes() == runner_b.tobytes()
    # The lr really is the record's: the same data at the constant base lr ends elsewhere.
    constant = make_batches(6, name="constant.mzb")
    assert run_runner(runner_args(runner_binary, tiny_program.files, constant, tmp_path / "c.f32", *width_arg))[0] == 0
    assert load_b(tmp_path / "c.f32").tobytes() != runner_b.tobytes()


def test_init_b_and_step_limit(
    runner_binary: Path, tiny_program: Program, make_batches: Callable[..., Path], tmp_path: Path
) -> None:
    batches = make_batches(3)
    init = np.random.default_rng(3).normal(0, 0.1, tiny_program.d).astype(np.float32)
    save_b(tmp_path / "init.f32", init)
    init_arg = ("--init-b", str(tmp_path / "init.f32"))
    args = runner_args(runner_binary, tiny_program.files, batches, tmp_path / "b.f32", *init_arg)
    status, lines, stderr = run_runner([*args, "--steps", "2"])
    assert status == 0, stderr
    reference, _ = python_reference(tiny_program, batches, init)
    assert len(lines) == 2
    assert as_f32(lines[1]["losses"]).tobytes() == reference[1][0].tobytes()
    save_b(tmp_path / "short.f32", init[:-1])
    status, _, stderr = run_runner([*args[:-1], str(tmp_path / "short.f32")])
    assert status == 1 and f"the program's B has {tiny_program.d}" in stderr


def test_stop_file_checkpoints_and_resume_is_bit_identical(
    runner_binary: Path, tiny_program: Program, make_batches: Callable[..., Path], tmp_path: Path
) -> None:
    batches = make_batches(7)
    status, full, _ = run_runner(runner_args(runner_binary, tiny_program.files, batches, tmp_path / "full.f32"))
    assert status == 0
    ckpt, stop = tmp_path / "run.ckpt", tmp_path / "STOP"
    stop.touch()
    args = runner_args(
        runner_binary,
        tiny_program.files,
        batches,
        tmp_path / "b.f32",
        "--checkpoint",
        str(ckpt),
        "--checkpoint-every",
        "3",
        "--job-id",
        "job-1",
        "--stop-file",
        str(stop),
    )
    status, first, stderr = run_runner(args)
    assert (status, len(first)) == (EXIT_STOPPED, 1), stderr
    saved = load_checkpoint(ckpt, "job-1")
    assert saved is not None and saved.next_step == 1
    assert not (tmp_path / "b.f32").exists()
    stop.unlink()
    status, rest, stderr = run_runner(args)
    assert status == 0, stderr
    assert [line["step"] for line in rest] == list(range(1, 7))
    assert first + rest == full
    assert (tmp_path / "b.f32").read_bytes() == (tmp_path / "full.f32").read_bytes()
    assert load_checkpoint(ckpt, "job-1").next_step == 7


def test_sigterm_finishes_the_step_and_checkpoints(
    runner_binary: Path, tiny_program: Program, make_batches: Callable[..., Path], tmp_path: Path
) -> None:
    batches = make_batches(2000)
    ckpt = tmp_path / "run.ckpt"
    args = runner_args(
        runner_binary, tiny_program.files, batches, tmp_path / "b.f32", "--checkpoint", str(ckpt), "--job-id", "j"
    )
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    lines = [json.loads(line) for line in [first, *out.splitlines()]]
    assert proc.returncode == EXIT_STOPPED, err
    assert "stopped after step" in err
    assert load_checkpoint(ckpt, "j").next_step == lines[-1]["step"] + 1 < 2000


def test_checkpoint_of_another_job_is_refused(
    runner_binary: Path, tiny_program: Program, make_batches: Callable[..., Path], tmp_path: Path
) -> None:
    batches = make_batches(2)
    save_checkpoint(tmp_path / "c", Checkpoint("job-old", 1, np.zeros(tiny_program.d, np.float32)))
    args = runner_args(
        runner_binary,
        tiny_program.files,
        batches,
        tmp_path / "b.f32",
        "--checkpoint",
        str(tmp_path / "c"),
        "--job-id",
        "job-new",
    )
    status, lines, stderr = run_runner(args)
    assert (status, lines) == (1, [])
    assert "belongs to job 'job-old'" in stderr


def test_batches_of_another_shape_are_refused(
    runner_binary: Path, tiny_program: Program, make_batches: Callable[..., Path], tmp_path: Path
) -> None:
    shape = tiny_program.shape
    batches = make_batches(2, shape=Shape(shape.rows, shape.seq_len + 1, shape.answer_len))
    status, _, stderr = run_runner(runner_args(runner_binary, tiny_program.files, batches, tmp_path / "b.f32"))
    assert status == 1 and "does not match the program" in stderr


@pytest.mark.parametrize(
    "edit, status, message",
    [
        (lambda a: a[:-2], 2, "--out-b is required"),
        (lambda a: [*a, "--bogus", "1"], 2, "unknown argument --bogus"),
        (lambda a: [*a, "--checkpoint-every", "2"], 2, "needs --checkpoint"),
        (lambda a: [*a[:8], "nan", *a[9:]], 2, "--eps"),
        (lambda a: [*a, "--lr", "0.1"], 2, "unknown argument --lr"),  # lr is each step's, from the batches file
        (lambda a: [a[0], "--program", "/nonexistent.pte", *a[3:]], 1, "cannot open /nonexistent.pte"),
        (lambda a: [*a[:4], "/nonexistent.ptd", *a[5:]], 1, "cannot open /nonexistent.ptd"),
        (lambda a: [*a[:6], "/nonexistent.mzb", *a[7:]], 1, "cannot open /nonexistent.mzb"),
    ],
)
def test_bad_invocations_fail_with_a_message(
    runner_binary: Path,
    tiny_program: Program,
    make_batches: Callable[..., Path],
    tmp_path: Path,
    edit: Callable[[list[str]], list[str]],
    status: int,
    message: str,
) -> None:
    args = edit(runner_args(runner_binary, tiny_program.files, make_batches(1), tmp_path / "b.f32"))
    got, _, stderr = run_runner(args)
    assert got == status and message in stderr, stderr


def test_runner_runs_each_step_at_its_longest_row_as_the_python_runtime_does(
    runner_binary: Path, tiny_program: Program, tmp_path: Path
) -> None:
    """With ``--min-width`` (the manifest's ``inputs.widths``) the runner cuts each step's all-padding columns, as
    ``ProgramSession`` does for the Python backends: the same bits, at widths from the narrowest to the full."""
    shape, widths = tiny_program.shape, tiny_program.manifest.inputs.widths
    steps = random_steps(shape, tiny_program.vocab, 6, seed=5, candidates=TINY_Q4.candidates)
    for k, step in enumerate(steps):  # step k: its first 2k columns padding in every row
        step.input_ids[:, : 2 * k], step.attention_mask[:, : 2 * k] = 0, 0
    write_batches(tmp_path / "short.mzb", shape, steps)
    used = {fit_width(s.input_ids, s.attention_mask, widths)[0].shape[1] for s in BatchesFile(tmp_path / "short.mzb")}
    assert min(used) < shape.seq_len and len(used) > 2
    args = runner_args(runner_binary, tiny_program.files, tmp_path / "short.mzb", tmp_path / "b.f32")
    status, lines, stderr = run_runner([*args, "--min-width", str(widths[0])])
    assert status == 0, stderr
    reference, final_b = python_reference(tiny_program, tmp_path / "short.mzb", widths=widths)
    for line, (losses, g) in zip(lines, reference, strict=True):
        assert as_f32(line["losses"]).tobytes() == losses.tobytes()
        assert as_f32(line["g"]).tobytes() == g.tobytes()
    assert load_b(tmp_path / "b.f32").tobytes() == final_b.tobytes()
