"""Compiling a job's program: its ``ProgramConfig`` (``program_config``), its cache key (``program_key``), and the
export itself (``build_program``), run in a worker process of the compile queue (``server.compile_queue``).

The compile queue imports this module only to name ``build_program`` for the pool; every heavy import (torch,
executorch, transformers) happens inside the functions, in the worker. Arguments and results are plain data (paths
as strings, dicts), so they pickle across the process boundary.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from functools import lru_cache
from pathlib import Path
from typing import Any


def program_config(spec: dict[str, Any], answer_len: int) -> dict[str, Any]:
    """The program config (as JSON) of a job spec (``JobCreate`` as JSON); ``ValueError`` if it does not fit."""
    from shared.manifest import ProgramConfig

    return ProgramConfig.from_spec(spec, answer_len).model_dump(mode="json")


def program_key(model_sha256: str, config: dict[str, Any], format_version: int) -> str:
    blob = json.dumps({"model": model_sha256, "config": config, "format": format_version}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def build_program(model_dir: str, model_sha256: str, spec: dict[str, Any], programs_dir: str, blobs_dir: str) -> dict:
    """Compile (or find in the cache) the program of a job → ``{"key", "manifest", "answer_len"}``.

    A config compiled before is found by its key and costs nothing; a new one is exported into a temporary
    directory that is renamed into place, so a concurrent build of the same key simply loses the rename. The base
    weights and tokenizer go to ``blobs_dir`` by content, so every program of a model shares one ``.ptd``.
    """
    from shared.files import make_dirs
    from shared.manifest import FORMAT_VERSION, ProgramConfig, manifest_path, read_manifest
    from shared.program import export_program

    answer_len = spec["answer_len"] or resolve_answer_len(Path(model_dir), spec)
    config = program_config(spec, answer_len)
    key = program_key(model_sha256, config, FORMAT_VERSION)
    final = Path(programs_dir) / key
    if not manifest_path(final / "program.pte").is_file():
        tmp = make_dirs(Path(programs_dir) / f".tmp-{uuid.uuid4().hex}")
        export_program(
            Path(model_dir),
            ProgramConfig.model_validate(config),
            tmp / "program.pte",
            Path(blobs_dir),
            progress=lambda _: None,
        )
        try:
            os.rename(tmp, final)
        except OSError:  # another worker published the same key first
            shutil.rmtree(tmp, ignore_errors=True)
    manifest = read_manifest(final / "program.pte").model_dump(mode="json")
    return {"key": key, "manifest": manifest, "answer_len": answer_len}


@lru_cache(maxsize=8)
def _tokenizer(model_dir: str):
    """Kept per worker process: every job without ``answer_len`` needs its model's tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def resolve_answer_len(model_dir: Path, spec: dict[str, Any]) -> int:
    """Tokens of the task's longest verbalizer answer (``shared.data.answer_len_for``), for classification jobs
    submitted without ``answer_len`` (the route requires it for the others, whose answers come from the data)."""
    from shared.data import answer_len_for
    from shared.tasks import get_task

    task = get_task(spec["task"] or "custom", spec["template"], spec["verbalizer"])
    return answer_len_for(task, _tokenizer(str(model_dir)))
