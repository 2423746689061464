"""Fixtures for the agent's tests: the host-built native runner, a real device program, batches files."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from device_agent.batches import Shape, write_batches
from tests.device_agent.helpers import Program, random_steps
from tests.utils.programs import TINY_Q4

RUNNER_DIR = Path(__file__).resolve().parents[2] / "device_agent" / "runner"
ADB_STANDIN_DIR = Path(__file__).resolve().parents[2] / "device_agent" / "adb_standin"


@pytest.fixture(scope="session")
def runner_binary() -> Path:
    """The runner built for this machine (build.sh is incremental: a no-op when nothing changed)."""
    result = subprocess.run([str(RUNNER_DIR / "build.sh")], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    return Path(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def tiny_program(program_factory, tiny_model_dir: Path) -> Program:
    """The real Mobile MP-LoRA program (shared.program, XNNPACK as in production) of the tiny model, q=4, E=2
    (``TINY_Q4``, exported once per session for the whole suite)."""
    pte, manifest = program_factory(TINY_Q4)
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    shape = Shape(rows=TINY_Q4.batch_size, seq_len=TINY_Q4.seq_len, answer_len=TINY_Q4.answer_len)
    return Program(pte, pte.parent / manifest.ptd.file, shape, vocab, manifest.lora_size, manifest)


@pytest.fixture
def make_batches(tmp_path: Path, tiny_program: Program) -> Callable[..., Path]:
    """Writes a batches file of ``count`` random steps for the tiny program and returns its path."""

    def make(count: int, shape: Shape | None = None, seed: int = 0, name: str = "batches.mzb") -> Path:
        shape = shape or tiny_program.shape
        path = tmp_path / name
        write_batches(path, shape, random_steps(shape, tiny_program.vocab, count, seed))
        return path

    return make
