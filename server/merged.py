"""Merged downloads: an adapter folded into its base (``shared.adapter.merge_adapter``: ``W + (alpha / r) B A`` in each
target linear), as a zipped plain Hugging Face model folder, built once per (adapter archive, dtype) and kept in the
store by content.

A merge holds the base model in memory (float32, with PEFT's copy of the target layers), so a process runs one at a
time: a request that finds one running is answered 429 with ``Retry-After`` at once, rather than holding a request
thread while it waits. A finished merge is found again through a pointer file, ``merged/<archive sha256>-<dtype>.json``
naming the zip's own sha256 (its ETag).
"""

from __future__ import annotations

import json
import shutil
import threading
import zipfile
from pathlib import Path

from server.responses import try_later
from server.store import ArtifactStore
from shared.files import atomic_write_bytes

RETRY_AFTER_S = 30  # a guess at one merge of a small model; not measured (a client retries on it)
_MERGING = threading.Lock()


def _zip_folder(folder: Path, out: Path) -> None:
    """``folder``'s files (sorted, stored without compression: safetensors does not compress) into ``out``."""
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:
        for path in sorted(p for p in folder.iterdir() if p.is_file()):
            zf.write(path, path.name)


def merged_archive(store: ArtifactStore, model_path: str, archive_sha256: str, dtype: str) -> tuple[Path, str]:
    """(path, sha256) of the zipped merged model of the adapter whose PEFT archive is ``archive_sha256`` on the base
    at ``model_path``, in ``dtype``; built now if it was not before (429 while another merge runs here)."""
    pointer = store.merged(f"{archive_sha256}-{dtype}.json")
    if pointer.is_file():
        sha256 = json.loads(pointer.read_text())["sha256"]
        path = store.merged(f"{sha256}.zip")
        if path.is_file():
            return path, sha256
    if not _MERGING.acquire(blocking=False):
        raise try_later(429, "another merged download is being built on this server", RETRY_AFTER_S)
    tmp = store.tmp_dir()
    try:
        from shared.adapter import merge_adapter

        with zipfile.ZipFile(store.archive(archive_sha256)) as zf:
            zf.extractall(tmp / "adapter")
        merge_adapter(Path(model_path), tmp / "adapter", tmp / "merged", dtype)
        _zip_folder(tmp / "merged", tmp / "merged.zip")
        path, sha256 = store.keep(tmp / "merged.zip", "merged", ".zip")
        atomic_write_bytes(pointer, json.dumps({"sha256": sha256}).encode())
        return path, sha256
    finally:
        _MERGING.release()
        shutil.rmtree(tmp, ignore_errors=True)
