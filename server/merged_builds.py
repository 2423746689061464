"""Merged downloads built on demand, outside any request and outside the API process, kept by content within bounds.

``GET /v1/adapters/{id}/merged?dtype=`` names a merge by its content key (``server.merged.merge_key``: the base, B,
the LoRA layout, the dtype), so adapters that share those share one file. The first request for a key starts the
merge on the compile queue (``CompileQueue.build_merged``: a compile worker process of this server, or with
``MOBIZO_QUEUE=celery`` a worker of the compile queue, behind every job's compile) and is told to come back (503 +
Retry-After); later requests find it building, then kept (a ``merged_files`` row and ``merged/<key>.zip``), which
they download as a file (streamed, with ETag and Range). The API process never loads a model for it.

Kept merges are bounded (``server.settings.Settings``): ``merged_per_user_mb`` for the merges a user's downloads
built, ``merged_total_mb`` for all; a merge that finishes past a bound evicts the least recently downloaded merges,
the user's own first (``state.programs.keep_merged``), and one that alone would pass a bound is refused before it
is built (422 naming ``dtype``: a smaller dtype may fit). Merges at once are bounded too: ``merged_builds`` in this
process, ``merged_builds_per_user`` for one user; one more is refused (429 + Retry-After), while asking for a merge
already building costs nothing. A failed merge is answered 503 for ``FAILED_RETRY_S`` (with its error), then tried
again.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from server import queries
from server.compile_queue import CompileQueue
from server.state import programs
from server.store import ArtifactStore
from shared.model_files import float32_bytes

log = logging.getLogger(__name__)
RETRY_S = 5  # a merge of a small model takes seconds (docs/guide/adapters.md): the wait before asking again
FAILED_RETRY_S = 60  # a failed merge is not tried again for this long
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MB = 1024 * 1024


class MergeBusy(RuntimeError):
    """Starting this merge would pass a bound on merges at once (the message says which)."""


class MergeTooLarge(ValueError):
    """This merge alone would pass a bound on kept merges (the message says which)."""


class MergeFailed(RuntimeError):
    """The merge failed a moment ago; ``retry_after_s``: when it may be tried again."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class MergeBounds:
    """Bytes of kept merges (of one user's downloads, of all) and merges building at once (in all, of one user)."""

    per_user_bytes: int
    total_bytes: int
    builds: int
    builds_per_user: int


def estimated_bytes(model_dir: str, dtype: str) -> int:
    """The merged weights' bytes in ``dtype``, from the base's safetensors headers (the zip adds its config and
    tokenizer); 0 when the headers cannot be read (the merge then fails with the reason)."""
    try:
        return float32_bytes(Path(model_dir)) * DTYPE_BYTES[dtype] // 4
    except (OSError, ValueError):
        return 0


class MergedBuilds:
    """``get`` answers the kept merge's sha256 (the merge now the most recently used) or None while it builds,
    starting it on first sight; raises ``MergeBusy``, ``MergeTooLarge`` or ``MergeFailed``."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        store: ArtifactStore,
        queue: CompileQueue,
        bounds: MergeBounds,
        paused: bool = False,
    ) -> None:
        self._sessions, self._store, self._queue, self._paused = sessions, store, queue, paused
        self.bounds = bounds
        self._drivers = ThreadPoolExecutor(bounds.builds, thread_name_prefix="merge")
        self._lock = threading.Lock()
        self._running: dict[str, int] = {}  # key → the user whose download started it
        self._failed: dict[str, tuple[str, float]] = {}  # key → (error, monotonic time it may be tried again)

    def get(
        self, session: Session, key: str, user_id: int, model_dir: str, archive_sha256: str, dtype: str
    ) -> str | None:
        """The merge ``key`` of the adapter whose archive is ``archive_sha256`` on the base at ``model_dir``."""
        kept = self._kept(session, key)
        if kept is not None:
            return kept
        with self._lock:
            if key in self._running:
                return None
            kept = self._kept(session, key)  # finished since the read above
            if kept is not None:
                return kept
            failed = self._failed.get(key)
            if failed is not None and failed[1] > time.monotonic():
                raise MergeFailed(failed[0], max(1, round(failed[1] - time.monotonic())))
            if self._paused:
                return None
            self._check_bounds(user_id, estimated_bytes(model_dir, dtype), dtype)
            self._running[key] = user_id
            self._drivers.submit(self._build, key, user_id, model_dir, archive_sha256, dtype)
        return None

    def _kept(self, session: Session, key: str) -> str | None:
        """The kept merge's sha256, touched; a row whose file is gone is forgotten (built again)."""
        row = queries.merged_file(session, key)
        if row is None:
            return None
        sha256 = row.sha256
        if not self._store.merged(key).is_file():
            programs.forget_merged(session, [key])
            return None
        programs.touch_merged(session, key)
        return sha256

    def _check_bounds(self, user_id: int, estimate: int, dtype: str) -> None:
        """``MergeTooLarge`` or ``MergeBusy`` when this merge may not start (the lock is held)."""
        bounds = self.bounds
        for bound, what in ((bounds.per_user_bytes, "one user's"), (bounds.total_bytes, "all")):
            if estimate > bound:
                raise MergeTooLarge(
                    f"the merged model in {dtype} takes about {estimate / MB:.0f} MB, more than the server keeps for "
                    f"{what} merged downloads ({bound / MB:.0f} MB)"
                )
        ours = sum(whose == user_id for whose in self._running.values())
        if ours >= bounds.builds_per_user:
            raise MergeBusy(f"merges building for your downloads: {ours} (at most {bounds.builds_per_user})")
        if len(self._running) >= bounds.builds:
            raise MergeBusy(f"merges building on the server: {len(self._running)} (at most {bounds.builds})")

    def _build(self, key: str, user_id: int, model_dir: str, archive_sha256: str, dtype: str) -> None:
        try:
            built = self._queue.build_merged(model_dir, archive_sha256, dtype, key)
            if built["size"] > min(self.bounds.per_user_bytes, self.bounds.total_bytes):
                self._store.drop_merged(key)
                raise MergeTooLarge(f"the merged model takes {built['size'] / MB:.0f} MB, more than a bound allows")
            with self._sessions() as session:
                evicted = programs.keep_merged(
                    session, key, user_id, built, self.bounds.per_user_bytes, self.bounds.total_bytes
                )
            for old in evicted:
                self._store.drop_merged(old)
            if evicted:
                log.info("merged download %s kept; evicted %d less recently used", key[:12], len(evicted))
        except Exception as exc:  # any failure of the merge is its error text, answered for a while
            log.warning("merged download %s: build failed: %s", key[:12], exc)
            with self._lock:
                self._failed[key] = (f"{type(exc).__name__}: {exc}", time.monotonic() + FAILED_RETRY_S)
        finally:
            with self._lock:
                self._running.pop(key, None)

    def remove_unrecorded(self, older_than_s: float = 0.0) -> int:
        """Remove files of ``merged/`` that no ``merged_files`` row names (an earlier layout's, or a merge kept
        just before a crash) → how many; with a data dir shared by servers, only those older than ``older_than_s``
        (by modification time), so that another process's merge between its file and its row is left alone."""
        with self._sessions() as session:
            recorded = {f"{key}.zip" for key in queries.merged_keys(session)}
        cutoff = time.time() - older_than_s
        stale = [
            path
            for path in self._store.merged_files()
            if path.name not in recorded and (not older_than_s or path.lstat().st_mtime < cutoff)
        ]
        for path in stale:
            path.unlink(missing_ok=True)
        return len(stale)

    def close(self) -> None:
        self._drivers.shutdown(wait=False, cancel_futures=True)
