"""What a device may download, by content: the one rule behind ``GET /v1/blobs/{sha256}``.

Every file a device fetches (a program's ``.pte``, the model's ``.ptd`` and tokenizer, a starting B, an adapter's B
for inference) is named by its sha256 in what the server handed it (a lease, an inference program, an adapter), and
fetched from the one route. A live device is granted

- the files of the work it holds now (``state.leases.held_work``: its running jobs, its parts in open rounds): their
  program's ``.pte``, ``.ptd`` and tokenizer, and their starting B;
- the B of every adapter its user may see (``registry.visible_to``, the registry's rule);
- the files of every inference program built (``programs.kind = "inference"``): a registered model compiled for a
  LoRA layout holds no user's data, and ``POST /v1/device/inference`` hands them to any device.

Anything else answers 404, as an unknown sha256 does: the answer does not tell a file that exists from one that
does not. The work held is read at each request, so a lease that ended (expired, cancelled, revoked) grants nothing
from the next request on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Select, select
from sqlalchemy.orm import Session

from server import registry
from server.compile import INFERENCE_PTE
from server.lru import LRUCache
from server.state import leases
from server.store import ArtifactStore
from server.tables import Adapter, Device, Program
from shared.manifest import InferenceManifest, ProgramManifest
from shared.schemas import FileRef, blob_url

JSON = "application/json"
_M = TypeVar("_M", ProgramManifest, InferenceManifest)


def blob_ref(sha256: str, size: int) -> FileRef:
    """The download of the file ``sha256`` (of ``size`` bytes), as a lease or an inference program names it."""
    return FileRef(url=blob_url(sha256), size=size, sha256=sha256)


@dataclass(frozen=True)
class Blob:
    """A file to serve: where it is, and the name and media type it is served under."""

    path: Path
    filename: str
    media_type: str = "application/octet-stream"


def program_file(
    store: ArtifactStore, key: str, manifest: ProgramManifest | InferenceManifest, sha256: str
) -> Blob | None:
    """The file of the program ``key`` whose content is ``sha256`` (its ``.pte``, ``.ptd`` or tokenizer), or None.
    Only that file's path is asked of the store (with a shared tier, asking fetches)."""
    if manifest.pte.sha256 == sha256:
        name = INFERENCE_PTE if isinstance(manifest, InferenceManifest) else "program.pte"
        return Blob(store.program(key, name), name)
    if manifest.ptd.sha256 == sha256:
        return Blob(store.blob(manifest.ptd.file), manifest.ptd.file)
    if manifest.tokenizer.sha256 == sha256:
        return Blob(store.blob(manifest.tokenizer.file), "tokenizer.json", JSON)
    return None


def _b(store: ArtifactStore, sha256: str) -> Blob:
    return Blob(store.adapter_b(sha256), "b.safetensors")


def granted(
    session: Session,
    store: ArtifactStore,
    manifests: LRUCache[int, Any],
    device: Device,
    sha256: str,
) -> Blob | None:
    """The file ``sha256`` if ``device`` was granted it (the module's rule), else None. Reads; does not commit."""
    held = leases.held_work(session, device.id)
    if sha256 in {init_b for _, init_b in held}:
        return _b(store, sha256)
    held_programs = select(Program.id, Program.key).where(Program.id.in_({program_id for program_id, _ in held}))
    found = _in_programs(session, store, manifests, held_programs, ProgramManifest, sha256)
    if found is not None:
        return found
    visible = select(Adapter.id).where(Adapter.b_sha256 == sha256, registry.visible_to(device.user_id))
    if session.scalar(visible.limit(1)) is not None:
        return _b(store, sha256)
    inference = select(Program.id, Program.key).where(Program.kind == "inference")
    return _in_programs(session, store, manifests, inference, InferenceManifest, sha256)


def _in_programs(
    session: Session, store: ArtifactStore, manifests: LRUCache[int, Any], programs: Select, kind: type, sha256: str
) -> Blob | None:
    """The file ``sha256`` among the files of ``programs`` (a query of their ids and keys), else None."""
    for program_id, key in session.execute(programs):
        found = program_file(store, key, device_manifest(session, manifests, program_id, kind), sha256)
        if found is not None:
            return found
    return None


def device_manifest(
    session: Session, manifests: LRUCache[int, Any], program_id: int, kind: type[_M] = ProgramManifest
) -> _M:
    """A program's manifest (training, or ``kind`` InferenceManifest) as devices get it (no server model path). A
    program row is written once and never changes, so each API process reads and parses it once (``server.lru``)."""
    manifest = manifests.get(program_id)
    if manifest is None:
        raw = session.scalar(select(Program.manifest).where(Program.id == program_id))
        manifest = kind.model_validate(raw).for_device()
        manifests.put(program_id, manifest)
    return manifest
