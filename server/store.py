"""The artifact store under ``MOBIZO_DATA_DIR``: programs, shared blobs, adapters, logs, archives.

Layout (everything but ``tmp/`` is written once and then only read):
  programs/<key>/program.pte, program.json   one directory per (model sha256, ProgramConfig); json = manifest
  blobs/weights-<sha256>.ptd                 base weights, shared by every program of a model
  blobs/tokenizer-<sha256>.json              the model's tokenizer
  adapters/<sha256>.safetensors              uploaded LoRA-B (``b_flat``)
  logs/<sha256>.jsonl                        training logs
  archives/<sha256>.zip                      PEFT archives
  rounds/<sha256>.json                       a federated round's account (its clients, logs, B_r and B_{r+1})
  tmp/                                       uploads and builds in progress (emptied at start, under the lock)
  server.lock                                held (flock) by the one server that runs the in-process queues
Files are written under ``tmp/`` (or a temporary sibling), fsynced and renamed (``shared.files``), so a reader
never sees half a file; content-addressed names make a repeated write of the same bytes a no-op. Folders are 0700
and files 0600 whatever the umask.
"""

from __future__ import annotations

import fcntl
import shutil
import tempfile
import time
from pathlib import Path
from typing import BinaryIO, TextIO

from shared.files import open_private, private_dir, store_by_content

_CHUNK = 1 << 20


class DataDirInUse(RuntimeError):
    """Another server process holds the data directory's lock."""


class ArtifactStore:
    """Paths of the store's files; creates its directories, 0700 like the root (files in them are 0600)."""

    def __init__(self, root: Path) -> None:
        self.root = private_dir(Path(root).resolve())
        for sub in ("programs", "blobs", "adapters", "logs", "archives", "rounds", "tmp"):
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

    def program(self, key: str) -> Path:
        return self.programs_dir / key / "program.pte"

    def blob(self, file_name: str) -> Path:
        """A file a manifest names (``weights-<sha>.ptd``, ``tokenizer-<sha>.json``)."""
        return self.blobs_dir / Path(file_name).name

    def adapter_b(self, sha256: str) -> Path:
        return self.root / "adapters" / f"{sha256}.safetensors"

    def log(self, sha256: str) -> Path:
        return self.root / "logs" / f"{sha256}.jsonl"

    def archive(self, sha256: str) -> Path:
        return self.root / "archives" / f"{sha256}.zip"

    def round_record(self, sha256: str) -> Path:
        """A federated round's account (``server.federation``): B_r, its clients in order, their logs, B_{r+1}."""
        return self.root / "rounds" / f"{sha256}.json"

    def keep(self, src: Path, kind: str, suffix: str) -> tuple[Path, str]:
        """Publish ``src`` (under ``tmp/``) as ``<kind>/<sha256><suffix>`` → (path, sha256)."""
        return store_by_content(src, self.root / kind, "", suffix)

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
