"""Helpers for the agent's tests: programs and batches, running the native runner, the Python reference."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from device_agent.batches import BatchesFile, Shape, StepBatch
from device_agent.et_program import ProgramSession
from shared.manifest import ProgramManifest

LR, EPS = "0.05", "0.01"  # LR: every step's lr in random_steps unless told otherwise


@dataclass(frozen=True)
class Program:
    """An exported training program and the shape of the batches it takes."""

    pte: Path
    ptd: Path
    shape: Shape
    vocab: int
    d: int  # length of b_flat
    manifest: ProgramManifest

    @property
    def files(self) -> tuple[Path, Path]:
        return self.pte, self.ptd


def random_steps(
    shape: Shape, vocab: int, count: int, seed: int = 0, lrs: list[float] | None = None, candidates: tuple = ()
) -> list[StepBatch]:
    """Left-padded random rows whose last ``answer_len`` tokens are the answer (as shared.data builds them); step k
    runs at ``lrs[k]`` (float32 values; None: float32 ``LR`` throughout); with a classification program's
    ``candidates``, each answer is one of them."""
    rng = np.random.default_rng(seed)
    lrs = [np.float32(LR).item()] * count if lrs is None else lrs
    steps = []
    for k in range(count):
        ids = rng.integers(1, vocab, (shape.rows, shape.seq_len))
        if candidates:
            ids[:, -1] = rng.choice(candidates, shape.rows)
        mask = np.ones_like(ids)
        for row, width in enumerate(rng.integers(0, shape.seq_len - shape.answer_len - 1, shape.rows)):
            ids[row, :width], mask[row, :width] = 0, 0
        targets = ids[:, shape.seq_len - shape.answer_len :].copy()
        steps.append(StepBatch(int(rng.integers(0, 2**31)), lrs[k], ids, mask, targets))
    return steps


def runner_args(
    binary: Path | str, program: tuple[Path | str, Path | str], batches: Path | str, out_b: Path | str, *extra: str
) -> list[str]:
    pte, ptd = program
    return [
        str(binary),
        "--program",
        str(pte),
        "--data",
        str(ptd),
        "--batches",
        str(batches),
        "--eps",
        EPS,
        "--out-b",
        str(out_b),
        *extra,
    ]


def run_runner(args: list[str]) -> tuple[int, list[dict], str]:
    """(exit status, parsed stdout lines, stderr); each line's ``seconds`` (its own time, which no other run
    repeats) is checked positive and left out, so that lines of two runs compare as their steps."""
    done = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert all(line.pop("seconds") > 0 for line in lines), done.stdout
    return done.returncode, lines, done.stderr


def python_reference(  # noqa: ANN201
    program: Program, batches: Path, init_b: np.ndarray | None = None, widths: tuple[int, int] | None = None
):
    """Per-step (losses, g) and the final B from the ExecuTorch Python runtime, from ``init_b`` (None: zeros; the
    program carries no B of its own); each step at its record's lr (and with ``widths``, at its longest row)."""
    session = ProgramSession(*program.files, widths=widths)
    session.set_b(np.zeros(program.d, np.float32) if init_b is None else init_b)
    steps = [session.step(batch, batch.lr, np.float32(EPS).item()) for batch in BatchesFile(batches)]
    return steps, session.get_b()


def as_f32(values: list[float]) -> np.ndarray:
    """Parsed %.9g text back to the float32 values the runner computed."""
    return np.asarray(values, dtype=np.float64).astype(np.float32)
