"""The torch side of the server, run only inside worker processes (``server.pool.WorkerPool``).

Routes and the compile queue import this module only to name its functions for the pool; every heavy import
(torch, executorch, transformers) happens inside the functions, in the worker. Arguments and results are plain
data (paths as strings, dicts), so they pickle across the process boundary.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
import zipfile
from functools import lru_cache
from pathlib import Path
from typing import Any

from server.results import ResultRejected

REPLAY_RTOL = 1e-4
REPLAY_ATOL = 1e-6
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)


def replay_tolerance(max_abs_b: float) -> float:
    """Largest accepted max |uploaded B - replayed B|: 1e-4 of max|B| plus 1e-6.

    The ExecuTorch program and the replay agree bit for bit (the noise is integer arithmetic and the update is
    the same float32 expression); the slack covers devices running the step in eager torch, whose kernels may
    round a few ulps differently, while a forged or wrong B is off by far more.
    """
    return REPLAY_RTOL * max_abs_b + REPLAY_ATOL


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
    from shared.manifest import FORMAT_VERSION, ProgramConfig, manifest_path, read_manifest
    from shared.program import export_program

    answer_len = spec["answer_len"] or resolve_answer_len(Path(model_dir), spec)
    config = program_config(spec, answer_len)
    key = program_key(model_sha256, config, FORMAT_VERSION)
    final = Path(programs_dir) / key
    if not manifest_path(final / "program.pte").is_file():
        tmp = Path(programs_dir) / f".tmp-{uuid.uuid4().hex}"
        tmp.mkdir()
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


def _load_b(path: str | None, d: int):
    """B of a B file (``shared.b_file``; checked when it was received), or zeros for a job without a start."""
    import torch

    from shared.b_file import read_b_file

    return torch.zeros(d, dtype=torch.float32) if path is None else torch.from_numpy(read_b_file(Path(path), d))


def _check_record(rec: dict, spec: dict[str, Any]) -> None:
    import numpy as np

    from shared.noise import step_seed

    where = f"step {rec['step']}"
    for key in ("lr", "eps"):
        if np.float32(rec[key]) != np.float32(spec[key]):
            raise ResultRejected("log", f"{where}: {key} {rec[key]!r} is not the job's {spec[key]}")
    if len(rec["g"]) != spec["q"] or len(rec["losses"]) != 2 * spec["q"]:
        raise ResultRejected("log", f"{where}: needs q={spec['q']} values of g and {2 * spec['q']} losses")
    if not np.isfinite(np.asarray(rec["losses"], dtype=np.float64)).all():
        raise ResultRejected("log", f"{where}: a loss is not finite")
    if rec["seed"] != step_seed(spec["seed"], rec["step"]):
        raise ResultRejected("log", f"{where}: seed {rec['seed']} is not the job's seed for this step")


def read_checked_log(log_path: str, spec: dict[str, Any]) -> list[dict]:
    """The log's records (``shared.replay.parse_log``), checked against the job: steps, lr, eps, q, seeds."""
    from shared.errors import DataError
    from shared.train_log import parse_log

    try:
        log = parse_log(Path(log_path).read_text(encoding="utf-8"), "log")
    except (DataError, UnicodeDecodeError) as exc:
        raise ResultRejected("log", str(exc)) from None
    if len(log) != spec["steps"]:
        raise ResultRejected("log", f"{len(log)} steps logged, the job has {spec['steps']}")
    for rec in log:
        _check_record(rec, spec)
    return log


def _check_replay(init_path: str | None, b_path: str, log: list[dict], d: int) -> dict[str, float]:
    from shared.replay import replay

    uploaded = _load_b(b_path, d)
    replayed = replay(_load_b(init_path, d), log)
    diff = float((replayed - uploaded).abs().max())
    tolerance = replay_tolerance(float(uploaded.abs().max()))
    if not diff <= tolerance:
        raise ResultRejected(
            "b_flat", f"does not match the replay of the log: max |diff| {diff:.3g} > tolerance {tolerance:.3g}"
        )
    return {"replay_max_abs_diff": diff, "replay_tolerance": tolerance}


def _zip_dir(src: Path, archive: Path) -> None:
    """A deterministic zip (sorted names, fixed dates), so the same adapter always hashes the same."""
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in sorted(p for p in src.rglob("*") if p.is_file()):
            info = zipfile.ZipInfo(path.relative_to(src).as_posix(), _ZIP_DATE)
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, path.read_bytes())


def package_adapter(job: dict[str, Any], b_path: str, out_dir: str) -> str:
    """Write the PEFT archive (A regenerated from the seed, B from the upload) → path of the zip."""
    from shared.adapter import save_program_adapter
    from shared.manifest import ProgramManifest

    adapter_dir = Path(out_dir) / "adapter"
    manifest = ProgramManifest.model_validate(job["manifest"])
    save_program_adapter(adapter_dir, manifest, _load_b(b_path, job["d"]), job["base_model"])
    archive = Path(out_dir) / "adapter.zip"
    _zip_dir(adapter_dir, archive)
    return str(archive)


def verify_and_package(job: dict[str, Any], b_path: str, log_path: str, init_path: str | None, out_dir: str) -> dict:
    """Check the log, replay it from the starting B and compare with the upload; then build the PEFT archive.

    ``job`` holds ``spec`` (JobSpec as JSON), ``manifest``, ``d`` and ``base_model``. Raises ``ResultRejected``
    for a log that is malformed, does not belong to the job, or does not reproduce the uploaded B.
    """
    log = read_checked_log(log_path, job["spec"])
    checks = _check_replay(init_path, b_path, log, job["d"])
    return {"archive": package_adapter(job, b_path, out_dir), **checks}
