"""Held-out evaluation through the native runner's ``evaluate`` mode (``device_agent/runner/README.md``): the
``device_agent.evaluation.Evaluator`` of the runner backends (``native``, ``adb``: ``RunnerBackend.evaluator``),
with no ExecuTorch Python runtime and no torch here.

All the points of a job go in one runner call: the chunks of rows as a batches file (``device_agent.batches``,
records of seed 0 and lr 1, which the mode does not read), every B back to back in one raw float32 file; the runner
loads the program once, sets each B in turn and prints the ``evaluate`` method's output for every chunk, one JSON
line each (``%.9g``: a float32 round-trips exactly, so the figures are the runner's bits).

Where the runner runs is the caller's: ``invoke(args)`` runs ``mobizo_runner`` with ``args`` there and returns its
stdout's JSON lines (a failure raises ``MobizoError``). Each ``Path`` in ``args`` is a file on this machine that
``invoke`` makes available there first and passes as that path (the runner backend pushes it through its
transport; ``local_invoke`` runs a runner on this host with the files where they are); other arguments are
strings. The files the evaluator writes are gone when the call returns; what ``invoke`` copied elsewhere (the rows
hold the user's tokens) is its to delete.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from device_agent.batches import Shape, StepBatch, write_batches
from device_agent.checkpoint import save_b
from shared.errors import MobizoError

Invoke = Callable[[list[str | Path]], Iterable[dict]]


def local_invoke(binary: Path) -> Invoke:
    """``invoke`` for a runner on this host: ``binary`` run with the arguments, files where they are."""

    def invoke(args: list[str | Path]) -> Iterator[dict]:
        done = subprocess.run([str(binary), *map(str, args)], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise MobizoError(f"the runner's {args[0]} mode failed ({done.returncode}): {runner_said(done.stderr)}")
        return (json.loads(line) for line in done.stdout.splitlines() if line.strip())

    return invoke


def runner_said(stderr: str) -> str:
    """What the runner said of its failure: its own lines (``mobizo_runner: ...``), without the runtime's log lines
    around them; else the end of its stderr."""
    own = [line for line in stderr.splitlines() if line.startswith("mobizo_runner:")]
    return "\n".join(own) if own else stderr.strip()[-2000:]


@dataclass(frozen=True)
class RunnerEvaluator:
    """A training program's ``evaluate`` on the native runner: ``program`` and ``weights`` (the run's ``.pte`` and
    ``.ptd`` here), ``widths`` the manifest's ``inputs.widths`` (each chunk at its longest row, as in training)."""

    invoke: Invoke
    program: Path
    weights: Path
    widths: tuple[int, int] | None = None

    def evaluate_points(self, points: Sequence[np.ndarray], chunks: Sequence[tuple]) -> list[np.ndarray]:
        if not points or not chunks:
            raise ValueError("an evaluation needs at least one B and one chunk of rows")
        ids, _, targets = chunks[0]
        shape = Shape(rows=ids.shape[0], seq_len=ids.shape[1], answer_len=targets.shape[1])
        with tempfile.TemporaryDirectory(prefix="mobizo-evaluate-") as tmp:
            rows, bs = Path(tmp) / "rows.mzb", Path(tmp) / "b.f32"
            write_batches(rows, shape, (StepBatch(0, 1.0, *chunk) for chunk in chunks))
            save_b(bs, np.concatenate([np.asarray(b, np.float32).reshape(-1) for b in points]))
            args: list[str | Path] = ["evaluate", "--program", self.program, "--data", self.weights]
            args += ["--batches", rows, "--b", bs]
            if self.widths is not None:
                args += ["--min-width", str(self.widths[0])]
            lines = list(self.invoke(args))  # read while the files exist: an invoke may push them as it runs
        return parse_evaluations(lines, len(points), len(chunks))


def parse_evaluations(lines: list[dict], points: int, chunks: int) -> list[np.ndarray]:
    """The evaluate mode's lines as one array per B, the chunks' outputs stacked (float32, the runner's bits);
    ``MobizoError`` unless there is exactly one line per (B, chunk), in order."""
    order = [(line.get("b"), line.get("chunk")) for line in lines]
    if order != [(p, c) for p in range(points) for c in range(chunks)]:
        raise MobizoError(f"the runner's evaluate mode printed {len(lines)} lines, not {points} B's x {chunks} chunks")
    values = [np.asarray(line["values"], dtype=np.float64).astype(np.float32).reshape(line["shape"]) for line in lines]
    return [np.stack(values[p * chunks : (p + 1) * chunks]) for p in range(points)]
