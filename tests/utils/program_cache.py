"""Exported programs kept across test sessions: a tiny-model export takes 50-200 s on 2 cores, so the suite exports
each program once per machine, not once per session (CI's second, ``ATEN_CPU_CAPABILITY=default`` pass and a
developer's next run export nothing).

An entry is keyed by everything that fixes the program's bytes: the kind of program, the model's files
(``model_sha256``), the program config, and a digest of the export's code (every file under ``shared/``) and of the
versions of torch, ExecuTorch and transformers. Change any of them and the key changes: a stale program is never
served. Entries live under ``.cache/test-programs/`` in the repository (git-ignored), or under the folder named by
``MOBIZO_TEST_PROGRAM_CACHE``; delete the folder to start over.

Reusing a program exported under other ATen kernels is deliberate: a server compiles a program on one machine and a
device runs it on another, so the suite's ``.pte`` = eager = replay identities must hold across that too.

The tiny model itself is kept here too: its seeded weights are byte-identical only under one set of ATen kernels
(torch's vectorized ``normal_`` rounds differently from the portable one), so CI's ``ATEN_CPU_CAPABILITY=default``
pass would otherwise build a model of other bytes, and every program key with it.

Tests whose subject is the export itself call ``export_program`` directly and do not come here.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path

from pydantic import BaseModel

REPO = Path(__file__).resolve().parents[2]
CACHE_ENV = "MOBIZO_TEST_PROGRAM_CACHE"
EXPORT_SOURCES = REPO / "shared"
VERSIONED = ("torch", "executorch", "transformers")
BUILD_LOG = "builds.jsonl"


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or REPO / ".cache" / "test-programs")


@functools.cache
def build_digest() -> str:
    """The export's code and the libraries it traces through: a new version of either invalidates every entry."""
    digest = hashlib.sha256()
    for path in sorted(EXPORT_SOURCES.rglob("*.py")):
        digest.update(path.relative_to(REPO).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    for package in VERSIONED:
        digest.update(f"{package}=={version(package)}\0".encode())
    return digest.hexdigest()


def entry_key(kind: str, model_dir: Path, config: BaseModel) -> str:
    from shared.model_files import model_sha256

    blob = {"kind": kind, "model": model_sha256(model_dir), "config": config.model_dump(mode="json")}
    return hashlib.sha256((json.dumps(blob, sort_keys=True) + build_digest()).encode()).hexdigest()


def cached_export(
    kind: str,
    model_dir: Path,
    config: BaseModel,
    store: Path,
    export: Callable[[Path, Path], object],
) -> Path:
    """The program ``export(pte, store)`` writes for ``config``, as ``store/<kind>-<key>.pte`` beside its manifest,
    weights and tokenizer → the ``.pte``'s path. Exported into the cache on a miss; copied from it on a hit, with
    the manifest's ``model`` set to ``model_dir`` as a fresh export would set it."""
    from shared.files import atomic_write_bytes, publish_once
    from shared.manifest import manifest_path

    key = entry_key(kind, model_dir, config)
    entry = cache_root() / key
    name = f"{kind}-{key[:16]}.pte"
    if not manifest_path(entry / name).is_file():
        with _locked(cache_root() / f".{key}.lock"):  # another session (a pytest-xdist worker) may be exporting it
            if not manifest_path(entry / name).is_file():
                started = time.perf_counter()
                publish_once(entry, lambda tmp: export(tmp / name, tmp))
                _log_build(kind, config.model_dump(mode="json", exclude_defaults=True), time.perf_counter() - started)
    store.mkdir(parents=True, exist_ok=True)
    for path in entry.iterdir():
        if not (store / path.name).exists():  # weights and tokenizer are named by content: shared between programs
            shutil.copyfile(path, store / path.name)
    manifest = json.loads(manifest_path(store / name).read_bytes())
    manifest["model"] = str(Path(model_dir).resolve())
    atomic_write_bytes(manifest_path(store / name), json.dumps(manifest, indent=2).encode())
    return store / name


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` for the block (released if the process dies)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def cached_model(recipe: str, make: Callable[[Path], object], data: tuple[Path, ...] = ()) -> Path:
    """The model folder ``make(folder)`` writes for ``recipe`` (its name and arguments), built once per machine
    → the cache entry's path (read it, never write into it). ``data``: files the model is built from (its
    tokenizer's corpus), part of the key."""
    digest = hashlib.sha256(f"{recipe}\0{build_digest()}".encode())
    for path in data:
        digest.update(path.read_bytes())
    entry = cache_root() / f"model-{digest.hexdigest()}"
    if not entry.is_dir():
        with _locked(cache_root() / f".{entry.name}.lock"):
            if not entry.is_dir():
                from shared.files import publish_once

                started = time.perf_counter()
                publish_once(entry, make)
                _log_build("model", recipe, time.perf_counter() - started)
    return entry


def _log_build(kind: str, what: object, seconds: float) -> None:
    """One line in ``cache_root()/builds.jsonl`` for a program or model this cache built (a miss): what, how long,
    and the test that asked. Lines of a few hundred bytes appended by one ``write`` each: workers never interleave."""
    line = {
        "at": time.time(),
        "kind": kind,
        "what": what,
        "seconds": round(seconds, 1),
        "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0],
    }
    with open(cache_root() / BUILD_LOG, "a") as log:
        log.write(json.dumps(line) + "\n")


def builds_since(started: float) -> list[dict]:
    """The cache's builds (``_log_build``) since ``started`` (a ``time.time()``), in the order they ended."""
    path = cache_root() / BUILD_LOG
    if not path.is_file():
        return []
    lines = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return [line for line in lines if line["at"] >= started]


# A server's compile cache, seeded from this one: tests whose subject is not the compile (a device's job, a worker
# taking over a job, a device's inference) find their program compiled, as a server that built it before would.


def seed_server_program(data_dir: Path, model_dir: Path, spec: dict, program_factory):
    """Put the training program of the job ``spec`` (``JobCreate`` fields) where a server on ``data_dir`` finds it
    compiled (``server.compile.build_program``, its config resolved as the server does) → its ``ProgramConfig``.
    Idempotent."""
    from server.compile import program_key, resolve_config
    from shared.manifest import FORMAT_VERSION, ProgramConfig
    from shared.model_files import model_sha256
    from shared.schemas import JobCreate

    job = JobCreate(**{"steps": 1, **spec}).model_dump(mode="json")
    config = resolve_config(model_dir, job)
    pte, manifest = program_factory(ProgramConfig.model_validate(config))
    key = program_key(model_sha256(model_dir), config, FORMAT_VERSION)
    _seed(data_dir, key, pte, "program.pte", manifest)
    return manifest.config


def seed_server_inference(data_dir: Path, model_dir: Path, pte: Path, manifest) -> Path:
    """Put an exported inference program where a server on ``data_dir`` finds it built for its config (a device's
    ``POST /v1/device/inference`` with that config). Idempotent."""
    from server.compile import INFERENCE_PTE, inference_key
    from shared.model_files import model_sha256

    key = inference_key(model_sha256(model_dir), manifest.config.model_dump(mode="json"))
    _seed(data_dir, key, pte, INFERENCE_PTE, manifest)


def _seed(data_dir: Path, key: str, pte: Path, name: str, manifest) -> None:
    from shared.files import publish_once
    from shared.manifest import manifest_path

    blobs = data_dir / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    for entry in (manifest.ptd, manifest.tokenizer):
        if not (blobs / entry.file).exists():
            shutil.copyfile(pte.parent / entry.file, blobs / entry.file)
    folder = data_dir / "programs" / key

    def copy(tmp: Path) -> None:
        shutil.copyfile(pte, tmp / name)
        manifest_path(tmp / name).write_bytes(manifest.to_json())

    if not manifest_path(folder / name).is_file():
        publish_once(folder, copy)
