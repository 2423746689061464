"""Fixtures for the agent's tests: the host-built native runner, a real device program, batches files."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from device_agent.batches import Shape, write_batches
from tests.device_agent.helpers import Program, random_steps

RUNNER_DIR = Path(__file__).resolve().parents[2] / "device_agent" / "runner"
ADB_STANDIN_DIR = Path(__file__).resolve().parents[2] / "device_agent" / "adb_standin"


@pytest.fixture(scope="session")
def runner_binary() -> Path:
    """The runner built for this machine (build.sh is incremental: a no-op when nothing changed)."""
    result = subprocess.run([str(RUNNER_DIR / "build.sh")], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    return Path(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def tiny_program(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Program:
    """The real Mobile MP-LoRA program (shared.program, XNNPACK as in production) of the tiny model, q=2, E=2.

    Exported once per session (about a minute: the slow part of this directory's tests).
    """
    from shared.program import ProgramConfig, export_program

    cfg = ProgramConfig(q=2, batch_size=4, seq_len=12, answer_len=1, rank=4, alpha=8.0)
    folder = tmp_path_factory.mktemp("program")
    manifest = export_program(tiny_model_dir, cfg, folder / "program.pte", progress=lambda _: None)
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    shape = Shape(rows=cfg.batch_size, seq_len=cfg.seq_len, answer_len=cfg.answer_len)
    return Program(folder / "program.pte", folder / manifest["ptd"]["file"], shape, vocab, manifest["lora_size"])


@pytest.fixture
def make_batches(tmp_path: Path, tiny_program: Program) -> Callable[..., Path]:
    """Writes a batches file of ``count`` random steps for the tiny program and returns its path."""

    def make(count: int, shape: Shape | None = None, seed: int = 0, name: str = "batches.mzb") -> Path:
        shape = shape or tiny_program.shape
        path = tmp_path / name
        write_batches(path, shape, random_steps(shape, tiny_program.vocab, count, seed))
        return path

    return make
