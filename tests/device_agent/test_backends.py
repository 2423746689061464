"""The three backends behind one interface: same steps, stop with a checkpoint, resume to the same bits.

executorch and adb (the stand-in phone running the host-built runner) run the same kernels, so they agree bit
for bit with each other and with themselves across a stop and resume; torch runs the same step eagerly and
agrees within float tolerance.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoConfig

from device_agent.backends import Backend, StepRecord, TrainRun
from device_agent.backends.make import make_backend
from device_agent.checkpoint import load_checkpoint
from shared.errors import MobizoError, UsageError
from shared.replay import replay
from tests.device_agent.conftest import ADB_STANDIN_DIR
from tests.device_agent.helpers import Program
from tests.utils.tolerance import b_drift, loss_rtol, losses_atol_with_drift

pytestmark = pytest.mark.slow  # the session's program export lands on the first of these
LR, EPS = float(np.float32(0.05)), float(np.float32(0.01))


def train_run(program: Program, batches: Path, tmp_path: Path, every: int = 3) -> TrainRun:
    return TrainRun(
        key="job-1-test",
        program=program.pte,
        weights=program.ptd,
        manifest=program.manifest,
        batches=batches,
        eps=EPS,
        init_b=np.zeros(program.d, np.float32),
        checkpoint=tmp_path / "ckpt",
        checkpoint_every=every,
    )


def train(backend: Backend, run: TrainRun, start: int = 0, b=None, stop_after: int | None = None, state=None):
    """(records, outcome); ``stop_after``: ask to stop once that many steps of this session are done."""
    records: list[StepRecord] = []
    outcome = backend.train(run, start, b, records.append, lambda: len(records) >= (stop_after or 10**9), state)
    return records, outcome


def as_log(records: list[StepRecord]) -> list[dict]:
    return [{"seed": r.seed, "g": r.g.tolist(), "lr": r.lr} for r in records]


def same_steps(a: list[StepRecord], b: list[StepRecord]) -> bool:
    return [(r.step, r.seed, r.losses.tobytes(), r.g.tobytes()) for r in a] == [
        (r.step, r.seed, r.losses.tobytes(), r.g.tobytes()) for r in b
    ]


@pytest.fixture
def phone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MOBIZO_FAKE_DEVICE_ROOT", str(tmp_path / "phone"))
    monkeypatch.setenv("PATH", f"{ADB_STANDIN_DIR}{os.pathsep}{os.environ['PATH']}")
    return tmp_path / "phone"


def test_executorch_stops_with_a_checkpoint_and_resumes_bit_identical(
    tiny_program: Program, make_batches: Callable[..., Path], tmp_path: Path
) -> None:
    backend, run = make_backend("executorch"), train_run(tiny_program, make_batches(9), tmp_path)
    full, done = train(backend, run)
    assert done.next_step == 9 and np.any(done.b != 0)
    first, stopped = train(backend, run, stop_after=4)
    assert (stopped.next_step, stopped.b) == (4, None)
    ckpt = load_checkpoint(run.checkpoint, run.key)
    assert ckpt.next_step == 4  # written on the stop, after the step-3 checkpoint
    rest, resumed = train(backend, run, ckpt.next_step, ckpt.b)
    assert same_steps(first + rest, full)
    assert resumed.b.tobytes() == done.b.tobytes()


@pytest.mark.parametrize("name,bundled", [("adb", False), ("native", False), ("native", True)])
def test_runner_backends_match_executorch_across_a_stop(
    name: str,
    bundled: bool,
    phone: Path,
    request: pytest.FixtureRequest,
    tiny_program: Program,
    make_batches: Callable[..., Path],
    tmp_path: Path,
) -> None:
    """The native runner on the stand-in phone (adb) and on this machine (native: its plain build, and its
    self-contained bundle, started through the bundle's own loader) stops on request with its checkpoint pulled
    here, and resumes to the bits of the ExecuTorch runtime in this process."""
    # a bundle named by its launcher, as a user names it (test_aarch64.py names one by its folder)
    runner = (
        request.getfixturevalue("runner_bundle") / "mobizo_runner"
        if bundled
        else request.getfixturevalue("runner_binary")
    )
    run = train_run(tiny_program, make_batches(300), tmp_path, every=7)
    full, done = train(make_backend("executorch"), run)
    backend = make_backend(name, runner=runner, work_dir=tmp_path / "work")
    root = phone / "data/local/tmp/mobizo" if name == "adb" else tmp_path / "work" / "native"
    first, stopped = train(backend, run, stop_after=5)  # the stop file is seen within a fraction of a second
    assert stopped.b is None and 5 <= stopped.next_step < 300
    ckpt = load_checkpoint(run.checkpoint, run.key)  # pulled from where the runner ran
    assert ckpt.next_step == stopped.next_step == first[-1].step + 1
    # The runner's B is the replay of its lines, bit for bit (what a resume after a killed agent relies on).
    assert replay(torch.zeros(tiny_program.d), as_log(first)).numpy().tobytes() == ckpt.b.tobytes()
    rest, resumed = train(backend, run, ckpt.next_step, ckpt.b)
    assert same_steps(first + rest, full)
    assert resumed.b.tobytes() == done.b.tobytes()
    (pushed,) = (root / "bin").iterdir()  # pushed once, under its content's name
    assert pushed.name.startswith("bundle-" if bundled else "runner-") and pushed.is_dir() == bundled
    backend.forget(run)
    assert not (root / "jobs" / run.key).exists()
    staged = root / "store" / f"{run.manifest.ptd.sha256}.ptd"  # the weights stay for the next job
    assert staged.read_bytes() == run.weights.read_bytes()
    if name == "native" and staged.stat().st_dev == run.weights.stat().st_dev:
        assert staged.stat().st_ino == run.weights.stat().st_ino  # linked, not copied, on one file system


@pytest.mark.parametrize("name", ["executorch", "adb"])
def test_a_momentum_program_resumes_from_b_and_its_state_bit_identical(
    name: str, phone: Path, runner_binary: Path, tiny_program_momentum: Program, make_batches, tmp_path: Path
) -> None:
    """Stopped, a momentum run keeps B in its checkpoint; resumed, the agent sets B and then the momentum rebuilt
    from the log (``trainlog.resume_point``; the runner's ``--init-state``): the run ends on the uninterrupted
    run's bits, and its log replays to them under momentum (not under sgd)."""
    from device_agent.trainlog import resume_point
    from shared.train_log import log_line, log_record

    # a tiny step takes about a millisecond and the stop file is polled every 0.2 s: enough steps that it lands
    run = train_run(tiny_program_momentum, make_batches(1500), tmp_path, every=0)
    full, done = train(make_backend("executorch"), run)
    backend = make_backend(name, runner=runner_binary) if name == "adb" else make_backend(name)
    first, stopped = train(backend, run, stop_after=4)
    assert stopped.b is None and 4 <= stopped.next_step < 1500
    log = tmp_path / "train_log.jsonl"
    log.write_text("".join(log_line(log_record(r.step, r.seed, r.lr, EPS, r.g, r.losses)) for r in first))
    start, b, state = resume_point(log, run.checkpoint, run.key, run.init_b, "momentum")
    assert start == stopped.next_step and state.shape == (tiny_program_momentum.d,) and np.abs(state).max() > 0
    rest, resumed = train(backend, run, start, b, state=state)
    assert same_steps(first + rest, full) and resumed.b.tobytes() == done.b.tobytes()
    records = as_log(full)
    assert replay(torch.zeros(tiny_program_momentum.d), records, "momentum").numpy().tobytes() == done.b.tobytes()
    assert replay(torch.zeros(tiny_program_momentum.d), records).numpy().tobytes() != done.b.tobytes()
    _, restarted = train(backend, run, start, b)  # without the state: another trajectory
    assert restarted.b.tobytes() != done.b.tobytes()


def test_adb_backend_runs_a_private_program_as_executorch_does(
    phone: Path, runner_binary: Path, program_factory, tiny_program: Program, make_batches, tmp_path: Path
) -> None:
    """A private program's forward takes each step's clip and noise: the agent pushes the run's to the phone and the
    runner passes step k's (``--private``), across a stop, to the same bits as the ExecuTorch runtime here."""
    from dataclasses import replace

    from shared.privacy import step_privatizer
    from tests.utils.programs import TINY_Q4

    pte, manifest = program_factory(TINY_Q4.model_copy(update={"private": True}))
    shape, vocab = tiny_program.shape, tiny_program.vocab
    program = Program(pte, pte.parent / manifest.ptd.file, shape, vocab, manifest.lora_size, manifest)
    private = lambda k: (0.5, step_privatizer(7, k, 0.5, 0.2).noise(TINY_Q4.q))  # noqa: E731
    run = replace(train_run(program, make_batches(1500), tmp_path, every=0), private=private)
    full, done = train(make_backend("executorch"), run)
    quiet, _ = train(make_backend("executorch"), replace(run, private=lambda k: (0.5, np.zeros(TINY_Q4.q, np.float32))))
    assert not np.array_equal(full[0].g, quiet[0].g)  # the noise is in g
    adb = make_backend("adb", runner=runner_binary)
    first, stopped = train(adb, run, stop_after=5)
    assert stopped.b is None and 5 <= stopped.next_step < 1500
    ckpt = load_checkpoint(run.checkpoint, run.key)
    rest, resumed = train(adb, run, ckpt.next_step, ckpt.b)
    assert same_steps(first + rest, full) and resumed.b.tobytes() == done.b.tobytes()


def test_adb_backend_reports_a_failing_runner(phone: Path, tiny_program: Program, tmp_path: Path) -> None:
    broken = tmp_path / "runner"
    broken.write_text("#!/bin/sh\necho 'no kernels here' >&2\nexit 1\n")
    broken.chmod(0o755)
    (tmp_path / "batches.mzb").write_bytes(b"")
    with pytest.raises(MobizoError, match="no kernels here"):
        train(make_backend("adb", runner=broken), train_run(tiny_program, tmp_path / "batches.mzb", tmp_path))


def test_torch_backend_agrees_with_the_program(
    tiny_program: Program, tiny_model_dir: Path, make_batches: Callable[..., Path], tmp_path: Path
) -> None:
    from shared.model_files import model_sha256

    run = train_run(tiny_program, make_batches(6), tmp_path)
    reference, ref_done = train(make_backend("executorch"), run)
    registered = {model_sha256(tiny_model_dir)}
    eager = make_backend("torch", model_dir=tiny_model_dir, device="cpu", registered=lambda: registered)
    records, done = train(eager, run)
    # Same steps in other kernels (eager ATen vs XNNPACK): each loss within the float32 forward bound, plus what the
    # B's drift apart by, which g = (l+ - l-) / 2eps magnifies; the drift bound comes from the measured g's.
    loss_atol = loss_rtol(AutoConfig.from_pretrained(tiny_model_dir)) * max(
        float(np.abs(r.losses).max()) for r in reference
    )
    g_ref, g_got = [r.g for r in reference], [r.g for r in records]
    drift = b_drift(g_ref, g_got, LR)
    for k, (got, want) in enumerate(zip(records, reference, strict=True)):
        atol = losses_atol_with_drift(loss_atol, g_ref, drift[k], tiny_program.d)
        np.testing.assert_allclose(got.losses, want.losses, rtol=0, atol=atol)
    assert np.abs(ref_done.b).max() > 10 * drift[-1]  # the bound says something about B ...
    np.testing.assert_allclose(done.b, ref_done.b, rtol=0, atol=drift[-1])
    # ... but it is exactly what its own log replays to (on CPU), which is what the server checks.
    assert replay(torch.zeros(tiny_program.d), as_log(records)).numpy().tobytes() == done.b.tobytes()


def test_torch_backend_runs_the_8da4w_base_of_an_8da4w_program(
    tiny_program: Program,
    tiny_program_8da4w: Program,
    tiny_model_dir: Path,
    make_batches: Callable[..., Path],
    tmp_path: Path,
) -> None:
    """First step, from B = 0: the eager torch backend and the 8da4w program within the quantization's own effect
    on the losses (the float32 program on the same batch; tests/shared/test_quantize.py derives that bound)."""
    from shared.model_files import model_sha256

    batches = make_batches(1)
    floats, _ = train(make_backend("executorch"), train_run(tiny_program, batches, tmp_path / "f"))
    program, _ = train(make_backend("executorch"), train_run(tiny_program_8da4w, batches, tmp_path / "q"))
    registered = {model_sha256(tiny_model_dir)}
    eager = make_backend("torch", model_dir=tiny_model_dir, device="cpu", registered=lambda: registered)
    records, _ = train(eager, train_run(tiny_program_8da4w, batches, tmp_path / "t"))
    want, effect = program[0].losses, np.abs(program[0].losses - floats[0].losses).max()
    loss_atol = loss_rtol(AutoConfig.from_pretrained(tiny_model_dir)) * float(np.abs(want).max())
    assert effect > 10 * loss_atol  # the base is quantized in the program ...
    np.testing.assert_allclose(records[0].losses, want, rtol=0, atol=effect + loss_atol)  # ... and in torch


def test_torch_backend_refuses_a_model_that_is_not_the_programs(
    tiny_program: Program, tiny_model_dir: Path, make_batches: Callable[..., Path], tmp_path: Path
) -> None:
    from shared.tiny_model import make_tiny_model

    run = train_run(tiny_program, make_batches(1), tmp_path)
    other_weights = make_tiny_model(tmp_path / "seed1", seed=1)
    with pytest.raises(MobizoError, match="not one the server has registered"):
        train(make_backend("torch", model_dir=other_weights, registered=lambda: {"0" * 64}), run)
    narrower = make_tiny_model(tmp_path / "narrow", seed=0, hidden=32)
    with pytest.raises(MobizoError, match="not the job's base model"):
        train(make_backend("torch", model_dir=narrower, device="cpu"), run)
    with pytest.raises(UsageError, match="--model-dir"):
        make_backend("torch")
