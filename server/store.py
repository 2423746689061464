"""The artifact store under ``MOBIZO_DATA_DIR``: programs, shared blobs, adapters, logs, archives.

Layout (everything but ``tmp/`` is written once and then only read):
  programs/<key>/program.pte, program.json   one directory per (model sha256, ProgramConfig); json = manifest
  blobs/weights-<sha256>.ptd                 base weights, shared by every program of a model
  blobs/tokenizer-<sha256>.json              the model's tokenizer
  adapters/<sha256>.safetensors              uploaded LoRA-B (``b_flat``)
  logs/<sha256>.jsonl                        training logs
  archives/<sha256>.zip                      PEFT archives
  merged/<key>.zip                           merged downloads, by what they are made of (``server.merged``); the
                                             one folder whose files are removed (``drop_merged``: evicted)
  rounds/<sha256>.json                       a federated round's account (its clients, logs, B_r and B_{r+1})
  tmp/                                       uploads and builds in progress (emptied at start, under the lock)
  server.lock                                held (flock) by the one server that runs the in-process queues
Files are written under ``tmp/`` (or a temporary sibling), fsynced and renamed (``shared.files``), so a reader
never sees half a file; content-addressed names make a repeated write of the same bytes a no-op. Folders are 0700
and files 0600 whatever the umask.

Shared by several machines, the store is either this directory on a shared volume, or an S3 bucket
(``MOBIZO_STORE_URL``, ``server.object_store``) behind a data dir per machine: everything published (``keep``,
``publish_program``) is uploaded under its relative name, and the accessors (``program``, ``blob``, ``adapter_b``…)
fetch a file this machine does not have yet. Downloads are still served from the local file (sha256 ETag, Range,
304), so clients do not change and never follow a redirect.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import BinaryIO, TextIO

from server.object_store import SharedObjects
from shared.files import PRIVATE_FILE, open_private, private_dir, sha256_file, store_by_content

_CHUNK = 1 << 20


class DataDirInUse(RuntimeError):
    """Another server process holds the data directory's lock."""


class ArtifactStore:
    """Paths of the store's files; creates its directories, 0700 like the root (files in them are 0600).
    With ``shared`` (a bucket), the root is this machine's cache of it."""

    def __init__(self, root: Path, shared: SharedObjects | None = None) -> None:
        self.root = private_dir(Path(root).resolve())
        self.shared = shared
        for sub in ("programs", "blobs", "adapters", "logs", "archives", "merged", "rounds", "tmp"):
            private_dir(self.root / sub)

    @property
    def programs_dir(self) -> Path:
        return self.root / "programs"

    @property
    def blobs_dir(self) -> Path:
        return self.root / "blobs"

    def lock(self) -> TextIO:
        """Take ``server.lock`` (an exclusive ``flock``, released when the process ends, however it ends) →
        the open lock file, to keep open while serving; ``DataDirInUse`` if another process holds it."""
        handle = open_private(self.root / "server.lock", "a")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            lock = self.root / "server.lock"
            raise DataDirInUse(f"another mobizo server is using {self.root} (it holds {lock})") from None
        return handle

    def clean_tmp(self, older_than_s: float = 0.0) -> int:
        """Remove what a previous run left in ``tmp/`` and half-built programs → how many entries; only safe
        while holding ``lock``, or (a data dir shared by servers and workers) for entries older than any live
        upload or export (``older_than_s``, by modification time)."""
        cutoff = time.time() - older_than_s
        entries = [*(self.root / "tmp").iterdir(), *self.programs_dir.glob(".tmp-*")]
        stale = [path for path in entries if not older_than_s or path.lstat().st_mtime < cutoff]
        for path in stale:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        return len(stale)

    def _here(self, name: str) -> Path:
        """The local path of ``name`` (relative to the root), fetched from the shared tier if this machine does
        not have it; absent when neither has it (the caller's open or stat then fails as it would without one)."""
        path = self.root / name
        if self.shared is not None and not path.exists():
            self.shared.get(name, path)
        return path

    def program(self, key: str, name: str = "program.pte") -> Path:
        """A file of the program folder ``key`` (``program.pte``, its manifest ``program.json``…)."""
        return self._here(f"programs/{key}/{Path(name).name}")

    def blob(self, file_name: str) -> Path:
        """A file a manifest names (``weights-<sha>.ptd``, ``tokenizer-<sha>.json``)."""
        return self._here(f"blobs/{Path(file_name).name}")

    def adapter_b(self, sha256: str) -> Path:
        return self._here(f"adapters/{sha256}.safetensors")

    def log(self, sha256: str) -> Path:
        return self._here(f"logs/{sha256}.jsonl")

    def archive(self, sha256: str) -> Path:
        return self._here(f"archives/{sha256}.zip")

    def merged(self, key: str) -> Path:
        """A merged download by its content key (``server.merged.merge_key``)."""
        return self._here(f"merged/{Path(key).name}.zip")

    def keep_merged(self, src: Path, key: str) -> dict[str, int | str]:
        """Publish ``src`` (under ``tmp/``) as the merged download ``key`` → its ``sha256`` and ``size``; uploaded to
        the shared tier, if any, before it is returned."""
        sha256, size = sha256_file(src), src.stat().st_size
        with open(src, "rb") as f:
            os.fchmod(f.fileno(), PRIVATE_FILE)
            os.fsync(f.fileno())
        path = self.root / "merged" / f"{Path(key).name}.zip"
        os.replace(src, path)
        self._publish(path)
        return {"sha256": sha256, "size": size}

    def drop_merged(self, key: str) -> None:
        """Remove the merged download ``key`` here and from the shared tier (evicted: its row is gone)."""
        name = f"merged/{Path(key).name}.zip"
        (self.root / name).unlink(missing_ok=True)
        if self.shared is not None:
            self.shared.delete_prefix(name)

    def merged_files(self) -> list[Path]:
        """Every file of this data dir's ``merged/`` (``MergedBuilds.remove_unrecorded`` checks them)."""
        return sorted((self.root / "merged").iterdir())

    def round_record(self, sha256: str) -> Path:
        """A federated round's account (``server.federation``): B_r, its clients in order, their logs, B_{r+1}."""
        return self._here(f"rounds/{sha256}.json")

    def keep(self, src: Path, kind: str, suffix: str) -> tuple[Path, str]:
        """Publish ``src`` (under ``tmp/``) as ``<kind>/<sha256><suffix>`` → (path, sha256); uploaded to the
        shared tier, if any, before it is returned (so a database row naming it never precedes the object)."""
        path, sha256 = store_by_content(src, self.root / kind, "", suffix)
        self._publish(path)
        return path, sha256

    def publish_program(self, key: str, manifest: dict) -> None:
        """Upload a built program folder (training or inference) and the blobs its ``manifest`` (JSON) names, its
        ``.ptd`` and tokenizer, to the shared tier: the blobs, then the folder's files with the manifest last, so
        that a manifest in the bucket means its program is there whole. A no-op without a shared tier."""
        if self.shared is None:
            return
        for entry in ("ptd", "tokenizer"):
            self._publish(self.blobs_dir / Path(manifest[entry]["file"]).name)
        folder = self.programs_dir / key
        for path in sorted(folder.iterdir(), key=lambda p: (p.suffix == ".json", p.name)):
            self._publish(path)

    def fetch_program(self, key: str) -> bool:
        """Bring the program folder ``key`` and its blobs from the shared tier into this data dir (the manifest
        last, as ``build_program``'s cache looks for it) → whether it is here now. A no-op without a shared tier."""
        manifest_file = self.programs_dir / key / "program.json"
        if self.shared is None or manifest_file.exists():
            return manifest_file.exists()
        tmp = self.tmp_dir()
        try:
            if not self.shared.get(f"programs/{key}/program.json", tmp / "program.json"):
                return False
            manifest = json.loads((tmp / "program.json").read_bytes())
            for entry in ("ptd", "tokenizer"):
                self.blob(manifest[entry]["file"])
            for entry in ("pte", "init_b"):
                if manifest.get(entry):
                    self.program(key, manifest[entry]["file"])
            private_dir(manifest_file.parent)
            os.replace(tmp / "program.json", manifest_file)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return True

    def _publish(self, path: Path) -> None:
        if self.shared is not None:
            self.shared.put(path.relative_to(self.root).as_posix(), path)

    def tmp_dir(self) -> Path:
        """A fresh private directory under ``tmp/`` (the caller removes it)."""
        return Path(tempfile.mkdtemp(dir=self.root / "tmp"))

    def spool(self, source: BinaryIO, limit: int, path: Path) -> bool:
        """Copy ``source`` to ``path``; False (and nothing kept) when it is larger than ``limit`` bytes."""
        size = 0
        with open_private(path) as out:
            while chunk := source.read(_CHUNK):
                size += len(chunk)
                if size > limit:
                    break
                out.write(chunk)
        if size > limit:
            path.unlink()
            return False
        return True
