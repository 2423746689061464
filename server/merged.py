"""Merged downloads, what a merge is made of and how one is built: an adapter folded into its base
(``shared.adapter.merge_adapter``: ``W + (alpha / r) B A`` in each target linear), as a zipped plain Hugging Face
model folder.

A merge depends on the base (its ``model_sha256`` and the prompts chosen for it, which the folder carries), B, the
LoRA layout (rank, alpha, targets, A's seed) and the dtype, and on nothing else of the adapter (not its card, which
names its job): ``merge_key`` hashes exactly those, so adapters that share them share one file. ``merge_archive``
runs in a compile worker process, never in the API process (it loads the base in float32 with PEFT's copy of the
target layers); ``server.merged_builds`` decides when, and keeps the results within their bounds.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import zipfile
from pathlib import Path

from shared.prompts import PROMPTS_FILE

MERGE_FORMAT = 1  # bumped when the merged folder's contents change for the same inputs


def prompts_sha256(model_dir: Path) -> str | None:
    """The sha256 of the prompts chosen for the base (``shared.prompts.PROMPTS_FILE``, copied into the merged
    folder), None when it has none."""
    path = Path(model_dir) / PROMPTS_FILE
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def merge_key(
    base_sha256: str,
    base_prompts: str | None,
    b_sha256: str,
    rank: int,
    alpha: float,
    targets: list[str],
    a_seed: int,
    dtype: str,
) -> str:
    """The content key of a merge: sha256 of its inputs (the base's identity, B, the LoRA layout, the dtype)."""
    parts = {
        "format": MERGE_FORMAT,
        "base": base_sha256,
        "prompts": base_prompts,
        "b": b_sha256,
        "rank": int(rank),
        "alpha": float(alpha),
        "targets": sorted(targets),
        "a_seed": int(a_seed),
        "dtype": dtype,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _zip_folder(folder: Path, out: Path) -> None:
    """``folder``'s files (sorted, stored without compression: safetensors does not compress) into ``out``."""
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:
        for path in sorted(p for p in folder.iterdir() if p.is_file()):
            zf.write(path, path.name)


def merge_archive(model_dir: str, archive: str, dtype: str, out: str) -> None:
    """In a worker process: the PEFT archive ``archive`` folded into the base at ``model_dir`` in ``dtype``, zipped
    into ``out`` (its folder is the caller's, removed by it)."""
    from shared.adapter import merge_adapter

    tmp = Path(tempfile.mkdtemp(dir=Path(out).parent))
    try:
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(tmp / "adapter")
        merge_adapter(Path(model_dir), tmp / "adapter", tmp / "merged", dtype)
        _zip_folder(tmp / "merged", Path(out))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
