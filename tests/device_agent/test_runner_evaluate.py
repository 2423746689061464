"""The native runner's evaluate mode against the ExecuTorch Python runtime: the same program, B and rows give the same
outputs bit for bit (the runner and the pybindings link the same kernels), and a job's held-out figures through the
runner (``RunnerEvaluator``, in a device install: no torch, ExecuTorch or transformers) are ``ProgramSession``'s, as
the runner backends measure them."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from device_agent.batches import Shape, StepBatch, write_batches
from device_agent.checkpoint import save_b
from device_agent.et_program import ProgramSession
from device_agent.evaluation import evaluate_program
from device_agent.runner_evaluator import RunnerEvaluator, local_invoke
from shared.errors import MobizoError
from tests.device_agent.helpers import Program, random_steps
from tests.device_agent.test_device_install import device_env
from tests.utils.programs import TINY_Q1, TINY_Q4

pytestmark = pytest.mark.slow  # the session's program exports


def chunks_of(program: Program, count: int, seed: int, candidates: tuple = ()) -> list[tuple]:
    """``count`` chunks of random left-padded rows (each of its own width) at the program's shape."""
    steps = random_steps(program.shape, program.vocab, count, seed, candidates=candidates)
    return [(s.input_ids, s.attention_mask, s.targets) for s in steps]


def points_of(d: int) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    return [np.zeros(d, np.float32), *(rng.normal(0, scale, d).astype(np.float32) for scale in (0.05, 0.5))]


def both(program: Program, runner: Path, points: list, chunks: list) -> tuple[list, list]:
    """(the runner's outputs, the Python runtime's) of the same B's and chunks, each at its longest row."""
    widths = program.manifest.inputs.widths
    ran = RunnerEvaluator(local_invoke(runner), *program.files, widths).evaluate_points(points, chunks)
    return ran, ProgramSession(*program.files, widths=widths).evaluate_points(points, chunks)


def test_a_classification_programs_scores_are_the_python_runtimes_bit_for_bit(
    runner_binary: Path, tiny_program: Program
) -> None:
    assert tiny_program.manifest.inputs.widths is not None  # each chunk at its longest row (--min-width)
    ran, want = both(tiny_program, runner_binary, points_of(tiny_program.d), chunks_of(tiny_program, 3, 5, (392, 373)))
    for got, expected in zip(ran, want, strict=True):
        assert got.dtype == np.float32 and got.shape == expected.shape == (3, tiny_program.shape.rows, 2)
        assert got.tobytes() == expected.tobytes()
    assert len({got.tobytes() for got in ran}) == 3  # every B scores otherwise


def test_a_language_modelling_programs_row_losses_are_the_python_runtimes_bit_for_bit(
    runner_binary: Path, program_factory, tiny_program: Program
) -> None:
    pte, manifest = program_factory(TINY_Q1)
    shape = Shape(rows=TINY_Q1.batch_size, seq_len=TINY_Q1.seq_len, answer_len=TINY_Q1.answer_len)
    program = Program(pte, pte.parent / manifest.ptd.file, shape, tiny_program.vocab, manifest.lora_size, manifest)
    ran, want = both(program, runner_binary, points_of(program.d), chunks_of(program, 4, 9))
    for got, expected in zip(ran, want, strict=True):
        assert got.shape == expected.shape == (4, TINY_Q1.batch_size) and got.tobytes() == expected.tobytes()
    assert np.all(ran[0] > 0) and ran[0].tobytes() != ran[2].tobytes()


_DEVICE = """
import json, sys
from pathlib import Path

import numpy as np

from device_agent.batches import Shape
from device_agent.evaluation import evaluate_points
from device_agent.runner_evaluator import RunnerEvaluator, local_invoke
from shared.data import load_examples
from shared.tasks import get_task
from shared.tokenizer_file import load_tokenizer_file

case = json.loads(Path(sys.argv[1]).read_text())
evaluator = RunnerEvaluator(local_invoke(Path(case["runner"])), Path(case["pte"]), Path(case["ptd"]), case["widths"])
points = [np.asarray(b, np.float32) for b in case["points"]]
rendered = load_examples(get_task("sst2"), case["data"], limit=21)
figures = evaluate_points(evaluator, points, rendered, load_tokenizer_file(Path(case["tokenizer"])),
                          Shape(*case["shape"]), "classification", tuple(case["candidates"]))
assert not {m.partition(".")[0] for m in sys.modules} & {"torch", "executorch", "transformers"}
print(json.dumps(figures))
"""


def test_held_out_figures_through_the_runner_without_torch_are_the_sessions(
    runner_binary: Path, tiny_program: Program, tmp_path: Path
) -> None:
    """21 SST-2 examples (three chunks of 8, the last padded), three B's in one runner call, in a device install:
    the figures ``evaluate_program`` gives through ``ProgramSession``."""
    from shared.data import load_examples
    from shared.tasks import get_task, task_data_dir
    from shared.tokenizer_file import load_tokenizer_file

    manifest, (pte, ptd) = tiny_program.manifest, tiny_program.files
    tokenizer_file = pte.parent / manifest.tokenizer.file
    data = task_data_dir() / "sst2" / "train.jsonl"
    points = points_of(tiny_program.d)
    case = {"runner": str(runner_binary), "pte": str(pte), "ptd": str(ptd), "widths": manifest.inputs.widths}
    case |= {"points": [b.tolist() for b in points], "data": str(data), "tokenizer": str(tokenizer_file)}
    case |= {"shape": list(vars(tiny_program.shape).values()), "candidates": list(TINY_Q4.candidates)}
    (tmp_path / "case.json").write_text(json.dumps(case))
    case_file = tmp_path / "case.json"
    run = subprocess.run(
        [sys.executable, "-c", _DEVICE, str(case_file)], capture_output=True, text=True, env=device_env()
    )
    assert run.returncode == 0, run.stderr[-3000:]
    through_runner = json.loads(run.stdout)
    session = ProgramSession(pte, ptd, widths=manifest.inputs.widths)
    rendered, tokenizer = load_examples(get_task("sst2"), data, limit=21), load_tokenizer_file(tokenizer_file)
    shape, candidates = tiny_program.shape, TINY_Q4.candidates
    for b, figures in zip(points, through_runner, strict=True):
        session.set_b(b)
        assert figures == evaluate_program(session, rendered, tokenizer, shape, "classification", candidates)
    assert figures["n"] == 21 and len({f["loss"] for f in through_runner}) == 3


def test_each_backend_measures_with_its_runtime_the_same_figures(
    runner_binary: Path, tiny_program: Program, tmp_path: Path
) -> None:
    """``Backend.evaluator``: the local backends' is the ExecuTorch runtime here, the native backend's the runner's
    evaluate mode under its work folder (the rows in the job's folder until ``forget``); both give the figures of
    every point alike."""
    from device_agent.backends import TrainRun
    from device_agent.backends.make import make_backend
    from device_agent.evaluation import evaluate_points
    from shared.data import load_examples
    from shared.tasks import get_task, task_data_dir
    from shared.tokenizer_file import load_tokenizer_file

    zeros = np.zeros(tiny_program.d, np.float32)
    run = TrainRun("job-e", *tiny_program.files, tiny_program.manifest, tmp_path / "b.mzb", 0.01, zeros, tmp_path, 0)
    local = make_backend("executorch").evaluator(run)
    assert isinstance(local, ProgramSession) and local.widths == tiny_program.manifest.inputs.widths
    native = make_backend("native", runner=runner_binary, work_dir=tmp_path / "work")
    evaluator = native.evaluator(run)
    assert isinstance(evaluator, RunnerEvaluator)
    rendered = load_examples(get_task("sst2"), task_data_dir() / "sst2" / "train.jsonl", limit=10)
    tokenizer = load_tokenizer_file(tiny_program.pte.parent / tiny_program.manifest.tokenizer.file)
    how = (rendered, tokenizer, tiny_program.shape, "classification", TINY_Q4.candidates)
    points = points_of(tiny_program.d)
    assert evaluate_points(evaluator, points, *how) == evaluate_points(local, points, *how)
    job = tmp_path / "work" / "native" / "jobs" / "job-e"
    assert sorted(p.name for p in job.iterdir()) == ["held-out-b.f32", "held-out-rows.mzb"]
    native.forget(run)
    assert not job.exists()


def test_bad_inputs_are_refused_with_the_reason(runner_binary: Path, tiny_program: Program, tmp_path: Path) -> None:
    pte, ptd = tiny_program.files
    chunk = chunks_of(tiny_program, 1, 2, (392, 373))
    rows = tmp_path / "rows.mzb"
    write_batches(rows, tiny_program.shape, [StepBatch(0, 1.0, *chunk[0])])
    save_b(tmp_path / "short.f32", np.zeros(tiny_program.d + 1, np.float32))
    base = [str(runner_binary), "evaluate", "--program", str(pte), "--data", str(ptd), "--batches", str(rows)]
    done = subprocess.run([*base, "--b", str(tmp_path / "short.f32")], capture_output=True, text=True)
    assert done.returncode == 1 and f"not a whole number of the program's B ({tiny_program.d} values" in done.stderr
    done = subprocess.run(base, capture_output=True, text=True)
    assert done.returncode == 2 and "--b is required" in done.stderr
    wide = replace(tiny_program.shape, seq_len=tiny_program.shape.seq_len + 1)
    ids, mask, targets = chunk[0]
    wider = StepBatch(0, 1.0, np.pad(ids, ((0, 0), (1, 0))), np.pad(mask, ((0, 0), (1, 0))), targets)
    write_batches(rows, wide, [wider])
    save_b(tmp_path / "b.f32", np.zeros(tiny_program.d, np.float32))
    done = subprocess.run([*base, "--b", str(tmp_path / "b.f32")], capture_output=True, text=True)
    assert done.returncode == 1 and "does not match the program's evaluate inputs" in done.stderr
    args = ["evaluate", "--program", pte, "--data", ptd, "--batches", rows, "--b", tmp_path / "b.f32"]
    with pytest.raises(MobizoError, match="evaluate mode failed \\(1\\).*does not match"):
        local_invoke(runner_binary)(args)
