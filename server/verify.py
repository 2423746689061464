"""Checking an uploaded result, the one home of what a valid result is: then packaging it as a PEFT archive.

In the request (cheap, no torch; bad tensors are rejected before a worker is asked to replay): the size limits
(``b_limit``, ``log_limit``, ``METRICS_LIMIT``), B's safetensors layout and values (``check_b``) and the metrics
(``parse_metrics``). In a worker process (``server.pool.WorkerPool``; torch is imported inside the functions):
the log's checks against the job, the replay of the log from the starting B, and the archive
(``verify_and_package``). Arguments and results of the worker side are plain data, so they pickle.

Rejections raise ``ResultRejected(field, message)``: picklable, so a worker can raise it too, and turned into a
422 naming the part by the route.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from shared.b_file import read_b_file
from shared.errors import DataError
from shared.manifest import ProgramManifest
from shared.schemas import JobSpec

METRICS_LIMIT = 1 << 20
_LOG_LINE_BYTES = 512  # step, seed, lr, eps and punctuation, generously
_FLOAT_BYTES = 32  # one float written with repr() and a separator
REPLAY_RTOL = 1e-4
REPLAY_ATOL = 1e-6
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)


class ResultRejected(ValueError):
    """An upload that is not a valid result for its job; nothing of it is stored."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(field, message)
        self.field = field
        self.message = message

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def b_size(manifest: dict[str, Any]) -> int:
    """D, the length of b_flat, as the program's manifest states it."""
    return ProgramManifest.model_validate(manifest).lora_size


def b_limit(d: int) -> int:
    """Largest acceptable B file: the tensor plus a small header."""
    return 4 * d + 4096


def log_limit(spec: JobSpec) -> int:
    """Largest acceptable log: one line per step with 3q floats."""
    return spec.steps * (_LOG_LINE_BYTES + 3 * spec.q * _FLOAT_BYTES) + 4096


def check_b(path: Path, d: int) -> None:
    """A B file (``shared.b_file``): exactly one tensor ``b_flat``, float32, shape [D], every value finite."""
    try:
        read_b_file(path, d)
    except DataError as exc:
        raise ResultRejected("b_flat", str(exc)) from None


def parse_metrics(data: bytes) -> dict[str, Any]:
    try:
        metrics = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ResultRejected("metrics", f"not JSON ({exc})") from None
    if not isinstance(metrics, dict):
        raise ResultRejected("metrics", "must be a JSON object")
    return metrics


def replay_tolerance(max_abs_b: float) -> float:
    """Largest accepted max |uploaded B - replayed B|: 1e-4 of max|B| plus 1e-6.

    The ExecuTorch program and the replay agree bit for bit (the noise is integer arithmetic and the update is
    the same float32 expression); the slack covers devices running the step in eager torch, whose kernels may
    round a few ulps differently, while a forged or wrong B is off by far more.
    """
    return REPLAY_RTOL * max_abs_b + REPLAY_ATOL


def _load_b(path: str | None, d: int):
    """B of a B file (``shared.b_file``; checked when it was received), or zeros for a job without a start."""
    import torch

    return torch.zeros(d, dtype=torch.float32) if path is None else torch.from_numpy(read_b_file(Path(path), d))


def _check_record(rec: dict, spec: dict[str, Any]) -> None:
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
    """The log's records (``shared.train_log.parse_log``), checked against the job: steps, lr, eps, q, seeds."""
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
