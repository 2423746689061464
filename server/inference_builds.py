"""Inference programs compiled on demand, outside any request, one build per cache key at a time in this process.

A device asks for the inference program of (model, config); the first request starts the export on the compile
queue (``CompileQueue.build_inference``: this server's compile workers, or with ``MOBIZO_QUEUE=celery`` the
workers of the compile queue) and is told to come back (503 + Retry-After); later requests find it building, then
built (the manifest in the store is the cache, so a restart keeps every program compiled before). A failed build is
remembered with its error until the server restarts, so a broken config does not recompile on every retry.

Builds are bounded (``server.settings.Settings``): ``inference_builds`` at once in all, ``inference_builds_per_user``
for the devices of one user and ``inference_builds_per_device`` for one device; a request that would start one more
is refused (``BuildsBusy``: 429 with the reason and Retry-After), while asking for a program someone's build is
already making costs nothing. The compile queue runs them behind every job's compile (``LocalCompileQueue``), so no
number of devices asking for programs keeps a job from compiling.
"""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.compile import INFERENCE_PTE, inference_key
from server.compile_queue import CompileQueue
from server.store import ArtifactStore

log = logging.getLogger(__name__)


class BuildFailed(RuntimeError):
    """The export of this inference program failed; the message is its error text."""


class BuildsBusy(RuntimeError):
    """Starting this build would pass a bound on builds at once (the message says which)."""


@dataclass(frozen=True)
class Bounds:
    """Inference builds at once: in all, for one user's devices, for one device."""

    total: int
    per_user: int
    per_device: int


@dataclass(frozen=True)
class _Build:
    future: Future
    device_id: int
    user_id: int


class InferenceBuilds:
    """``get`` answers a manifest (JSON) when the program is built, None while it builds, or raises ``BuildFailed``
    (the build failed) or ``BuildsBusy`` (one more build would pass ``bounds``)."""

    def __init__(
        self, store: ArtifactStore, queue: CompileQueue, drivers: int, bounds: Bounds, paused: bool = False
    ) -> None:
        self._store, self._queue, self._paused = store, queue, paused  # paused: serve built programs only
        self._bounds = bounds
        self._drivers = ThreadPoolExecutor(drivers, thread_name_prefix="inference-build")
        self._lock = threading.Lock()
        self._running: dict[str, _Build] = {}
        self._failed: dict[str, str] = {}

    def get(
        self, model_dir: str, model_sha256: str, config: dict[str, Any], device_id: int, user_id: int
    ) -> tuple[str, dict | None]:
        """(key, manifest or None while building); starts the build on first sight of the key, for ``device_id`` of
        ``user_id`` (whom its bounds count it against)."""
        key = inference_key(model_sha256, config)
        with self._lock:
            if key in self._failed:
                raise BuildFailed(self._failed[key])
            running = self._running.get(key)
            if running is None or running.future.done():
                built = self._read(key)
                if built is not None:
                    self._running.pop(key, None)
                    return key, built
                if self._paused:
                    return key, None
                self._check_bounds(device_id, user_id)
                future = self._drivers.submit(self._build, key, model_dir, model_sha256, config)
                self._running[key] = _Build(future, device_id, user_id)
        return key, None

    def _check_bounds(self, device_id: int, user_id: int) -> None:
        """``BuildsBusy`` when one more build for this device would pass a bound (the lock is held)."""
        building = [b for b in self._running.values() if not b.future.done()]
        mine = sum(b.device_id == device_id for b in building)
        ours = sum(b.user_id == user_id for b in building)
        bounds = self._bounds
        if mine >= bounds.per_device:
            raise BuildsBusy(f"this device has {mine} inference programs building (at most {bounds.per_device})")
        if ours >= bounds.per_user:
            raise BuildsBusy(f"your devices have {ours} inference programs building (at most {bounds.per_user})")
        if len(building) >= bounds.total:
            raise BuildsBusy(f"the server is building {len(building)} inference programs (at most {bounds.total})")

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
