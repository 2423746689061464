"""Fixtures for the agent's tests: the host-built native runner, a real device program, batches files."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from device_agent.batches import Shape, write_batches
from shared.tasks import task_data_dir
from tests.device_agent.helpers import Program, random_steps
from tests.device_agent.stack import SPEC, Stack, server_env
from tests.server import live
from tests.utils.program_cache import seed_server_program
from tests.utils.programs import TINY_Q4, TINY_Q4_8DA4W, TINY_Q4_MOMENTUM

ADB_STANDIN_DIR = Path(__file__).resolve().parents[2] / "device_agent" / "adb_standin"


@pytest.fixture(scope="session")
def tiny_program(program_factory, tiny_model_dir: Path) -> Program:
    """The real Mobile MP-LoRA program (shared.program, XNNPACK as in production) of the tiny model, q=4, E=2
    (``TINY_Q4``, exported once per session for the whole suite)."""
    pte, manifest = program_factory(TINY_Q4)
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    shape = Shape(rows=TINY_Q4.batch_size, seq_len=TINY_Q4.seq_len, answer_len=TINY_Q4.answer_len)
    return Program(pte, pte.parent / manifest.ptd.file, shape, vocab, manifest.lora_size, manifest)


@pytest.fixture(scope="session")
def tiny_program_8da4w(program_factory, tiny_program: Program) -> Program:
    """``TINY_Q4`` with 8da4w base linears (``TINY_Q4_8DA4W``): the same shapes, so ``make_batches`` fits it."""
    pte, manifest = program_factory(TINY_Q4_8DA4W)
    return Program(
        pte, pte.parent / manifest.ptd.file, tiny_program.shape, tiny_program.vocab, manifest.lora_size, manifest
    )


@pytest.fixture(scope="session")
def tiny_program_momentum(program_factory, tiny_program: Program) -> Program:
    """``TINY_Q4`` whose step moves B with momentum (``TINY_Q4_MOMENTUM``): its state buffer beside B."""
    pte, manifest = program_factory(TINY_Q4_MOMENTUM)
    return Program(
        pte, pte.parent / manifest.ptd.file, tiny_program.shape, tiny_program.vocab, manifest.lora_size, manifest
    )


@pytest.fixture
def make_batches(tmp_path: Path, tiny_program: Program) -> Callable[..., Path]:
    """Writes a batches file of ``count`` random steps for the tiny program (step k at ``lrs[k]``, default the
    constant ``helpers.LR``) and returns its path."""

    def make(
        count: int,
        shape: Shape | None = None,
        seed: int = 0,
        name: str = "batches.mzb",
        lrs: list[float] | None = None,
    ) -> Path:
        shape = shape or tiny_program.shape
        path = tmp_path / name
        write_batches(path, shape, random_steps(shape, tiny_program.vocab, count, seed, lrs, TINY_Q4.candidates))
        return path

    return make


# The live stack of the end-to-end tests (test_agent_e2e, test_federation_e2e, test_pause_e2e, ...).


def _seeded_artifacts(program_factory, tiny_model_dir: Path, folder: Path) -> Path:
    seeded = seed_server_program(folder, tiny_model_dir, SPEC, program_factory)  # the jobs are ready at once
    assert seeded == TINY_Q4, "SPEC must describe the suite's TINY_Q4 program: one export serves every test"
    momentum = seed_server_program(folder, tiny_model_dir, {**SPEC, "optimizer": "momentum"}, program_factory)
    assert momentum == TINY_Q4_MOMENTUM  # a momentum job's program, the one the backend tests run
    return folder


@pytest.fixture(scope="module")
def artifacts(program_factory, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data folder for a server of the test's own, its compile cache holding the suite's TINY_Q4 program (the
    jobs' config)."""
    return _seeded_artifacts(program_factory, tiny_model_dir, tmp_path_factory.mktemp("artifacts"))


@pytest.fixture(scope="session")
def local_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The device's data folder: 64 SST-2 rows as ``sst2/train.jsonl``."""
    folder = tmp_path_factory.mktemp("device-data")
    (folder / "sst2").mkdir()
    with open(task_data_dir() / "sst2" / "train.jsonl") as f:
        (folder / "sst2" / "train.jsonl").write_text("".join(itertools.islice(f, 64)))
    return folder


@pytest.fixture(scope="session")
def live_server(program_factory, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """One ``mobizo server`` process on loopback (SQLite) for the whole session → (its URL, its data folder,
    seeded like ``artifacts``). Tests that stop or restart a server start their own instead."""
    tmp = tmp_path_factory.mktemp("live-server")
    folder = _seeded_artifacts(program_factory, tiny_model_dir, tmp / "artifacts")
    with live.server_process(server_env(folder, tmp / "db.sqlite"), tmp / "server.log") as url:
        yield url, folder


@pytest.fixture
def stack(live_server: tuple[str, Path], tiny_model_dir: Path, tmp_path: Path) -> Stack:
    """The session's server, as a new user (the model ``tiny`` registered); agents work under ``tmp_path``."""
    url, folder = live_server
    return Stack(url, folder, tmp_path, tiny_model_dir)
