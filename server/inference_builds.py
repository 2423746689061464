"""Inference programs compiled on demand, outside any request, one build per cache key at a time in this process.

A device asks for the inference program of (model, config); the first request starts the export on the compile
queue (``CompileQueue.build_inference``: this server's compile workers, or with ``MOBIZO_QUEUE=celery`` the
workers of the compile queue) and is told to come back (503 + Retry-After); later requests find it building, then
built (the manifest in the store is the cache, so a restart keeps every program compiled before). A failed build is
remembered with its error until the server restarts, so a broken config does not recompile on every retry.
"""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from server.compile import INFERENCE_PTE, inference_key
from server.compile_queue import CompileQueue
from server.store import ArtifactStore

log = logging.getLogger(__name__)


class BuildFailed(RuntimeError):
    """The export of this inference program failed; the message is its error text."""


class InferenceBuilds:
    """``get`` answers a manifest (JSON) when the program is built, None while it builds, or raises ``BuildFailed``."""

    def __init__(self, store: ArtifactStore, queue: CompileQueue, drivers: int, paused: bool = False) -> None:
        self._store, self._queue, self._paused = store, queue, paused  # paused: serve built programs only
        self._drivers = ThreadPoolExecutor(drivers, thread_name_prefix="inference-build")
        self._lock = threading.Lock()
        self._running: dict[str, Future] = {}
        self._failed: dict[str, str] = {}

    def get(self, model_dir: str, model_sha256: str, config: dict[str, Any]) -> tuple[str, dict | None]:
        """(key, manifest or None while building); starts the build on first sight of the key."""
        key = inference_key(model_sha256, config)
        with self._lock:
            if key in self._failed:
                raise BuildFailed(self._failed[key])
            running = self._running.get(key)
            if running is None or running.done():
                built = self._read(key)
                if built is not None:
                    self._running.pop(key, None)
                    return key, built
                if self._paused:
                    return key, None
                self._running[key] = self._drivers.submit(self._build, key, model_dir, model_sha256, config)
        return key, None

    def _read(self, key: str) -> dict | None:
        from shared.manifest import manifest_path

        path = self._store.program(key, manifest_path(Path(INFERENCE_PTE)).name)  # built here, or fetched
        return json.loads(path.read_bytes()) if path.is_file() else None

    def _build(self, key: str, model_dir: str, model_sha256: str, config: dict[str, Any]) -> None:
        try:
            self._queue.build_inference(model_dir, model_sha256, config, key)
        except Exception as exc:  # any failure of the export is the program's error text
            log.warning("inference program %s: build failed: %s", key, exc)
            with self._lock:
                self._failed[key] = f"{type(exc).__name__}: {exc}"

    def close(self) -> None:
        self._drivers.shutdown(wait=False, cancel_futures=True)
