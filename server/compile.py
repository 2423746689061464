"""Compiling a job's program: its ``ProgramConfig`` (``program_config``), its cache key (``program_key``), and the
export itself (``build_program``), run in a worker process of the compile queue (``server.compile_queue``).

The compile queue imports this module only to name ``build_program`` for the pool; every heavy import (torch,
executorch, transformers) happens inside the functions, in the worker. Arguments and results are plain data (paths
as strings, dicts), so they pickle across the process boundary.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from functools import lru_cache, partial
from pathlib import Path
from typing import Any


def resolve_config(model_dir: Path, spec: dict[str, Any]) -> dict[str, Any]:
    """The program config (as JSON) of a job spec, resolved with its model (``shared.program_config``): the chat
    frame, the objective with its candidates' ids, the answer length and a calibrated job's prior. ``UsageError``
    naming the field a job cannot have with this model."""
    from shared.program_config import resolve_program
    from shared.tasks import get_task, with_chat

    chat = resolve_chat(Path(model_dir), spec)
    task = with_chat(get_task(spec["task"] or "custom", spec["template"], spec["verbalizer"]), chat)
    verbalizer = json.dumps(spec["verbalizer"], sort_keys=True)
    prior = partial(_prior, str(model_dir), spec["task"] or "custom", spec["template"], verbalizer, chat)
    return resolve_program(spec, task, _tokenizer(str(model_dir)), chat, prior).model_dump(mode="json")


@lru_cache(maxsize=8)
def _prior(model_dir: str, task_name: str, template: str | None, verbalizer: str, chat) -> tuple[float, ...]:
    """A calibrated job's prior (``shared.calibration``) on the base model, kept per worker process."""
    from shared.evaluate import measure_prior
    from shared.hf_models import load_model
    from shared.tasks import get_task, with_chat

    model, tokenizer = load_model(Path(model_dir))
    return measure_prior(model, tokenizer, with_chat(get_task(task_name, template, json.loads(verbalizer)), chat))


def program_key(model_sha256: str, config: dict[str, Any], format_version: int) -> str:
    blob = json.dumps({"model": model_sha256, "config": config, "format": format_version}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


class ExportTooLarge(Exception):
    """The export would need more memory than the compile worker has: the job fails with the figures."""


def check_export_memory(model_dir: Path, limit_mb: int | None, quantize: str = "none") -> None:
    """Refuse, before loading anything, an export that would not fit: a worker killed by the kernel's OOM killer
    says nothing useful (and may take the machine's other work down with it). ``limit_mb``: the configured budget
    (``MOBIZO_COMPILE_MEMORY_MB``); None: the memory available now. A quantized program's export needs less: its
    model is quantized right after loading."""
    from shared.memory import export_need_mb, free_memory_mb
    from shared.model_files import float32_bytes

    need = export_need_mb(float32_bytes(model_dir), quantize)
    have, where = (limit_mb, "MOBIZO_COMPILE_MEMORY_MB") if limit_mb is not None else (free_memory_mb(), "available")
    if have is not None and need > have:
        raise ExportTooLarge(
            f"exporting this model's program needs about {need} MB of memory and {have} MB is {where}: "
            "compile it on a server with more memory"
        )


def build_program(
    model_dir: str,
    model_sha256: str,
    spec: dict[str, Any],
    programs_dir: str,
    blobs_dir: str,
    memory_mb: int | None = None,
    fetch: Callable[[str], object] | None = None,
) -> dict:
    """Compile (or find in the cache) the program of a job → ``{"key", "manifest", "answer_len"}``.

    A config compiled before is found by its key and costs nothing; a new one is exported into a temporary
    directory that is renamed into place, so a concurrent build of the same key simply loses the rename. The base
    weights and tokenizer go to ``blobs_dir`` by content, so every program of a model shares one ``.ptd``.
    ``fetch(key)`` first brings a program another machine published into the cache (``ArtifactStore``).
    """
    from shared.files import publish_once
    from shared.manifest import FORMAT_VERSION, ProgramConfig, manifest_path, read_manifest
    from shared.program import export_program

    config = resolve_config(Path(model_dir), spec)
    answer_len = config["answer_len"]
    key = program_key(model_sha256, config, FORMAT_VERSION)
    final = Path(programs_dir) / key
    if fetch is not None:
        fetch(key)
    if not manifest_path(final / "program.pte").is_file():
        check_export_memory(Path(model_dir), memory_mb, config["quantize"])
        cfg = ProgramConfig.model_validate(config)
        publish_once(
            final,
            lambda tmp: export_program(
                Path(model_dir), cfg, tmp / "program.pte", Path(blobs_dir), progress=lambda _: None, memory_mb=memory_mb
            ),
        )
    manifest = read_manifest(final / "program.pte").model_dump(mode="json")
    return {"key": key, "manifest": manifest, "answer_len": answer_len}


@lru_cache(maxsize=8)
def _tokenizer(model_dir: str):
    """Kept per worker process: every job without ``answer_len`` needs its model's tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def resolve_chat(model_dir: Path, spec: dict[str, Any]) -> tuple[str, str] | None:
    """The model's chat frame for a job submitted with ``chat_template``, else None."""
    from shared.tasks import chat_frame

    return chat_frame(_tokenizer(str(model_dir))) if spec.get("chat_template") else None


INFERENCE_PTE = "inference.pte"


def build_inference(
    model_dir: str, model_sha256: str, config: dict[str, Any], programs_dir: str, blobs_dir: str
) -> dict:
    """Compile (or find in the cache) a model's inference program → its manifest (JSON), like ``build_program``:
    cached under ``inference_key``, published by renaming a temporary folder, weights and tokenizer by content in
    ``blobs_dir`` (the very ``.ptd`` of the model's training programs)."""
    from shared.files import publish_once
    from shared.inference_program import export_inference_program
    from shared.manifest import InferenceConfig, manifest_path, read_inference_manifest

    final = Path(programs_dir) / inference_key(model_sha256, config)
    if not manifest_path(final / INFERENCE_PTE).is_file():
        cfg = InferenceConfig.model_validate(config)
        publish_once(
            final,
            lambda tmp: export_inference_program(
                Path(model_dir), cfg, tmp / INFERENCE_PTE, Path(blobs_dir), progress=lambda _: None
            ),
        )
    return read_inference_manifest(final / INFERENCE_PTE).model_dump(mode="json")


def inference_key(model_sha256: str, config: dict[str, Any]) -> str:
    """The cache key of an inference program: (model, config, format), apart from every training program's key."""
    from shared.manifest import INFERENCE_FORMAT_VERSION

    return program_key(model_sha256, {"inference": config}, INFERENCE_FORMAT_VERSION)
