"""Downloads for a job's device: the program (``.pte``), base weights (``.ptd``), tokenizer and starting B.

Each answers with ``ETag: "<sha256>"`` and supports ``Range`` (resume) and ``If-Range``; ``If-None-Match`` with
the same sha256 answers 304. Only devices of the job's user see them (404 for anyone else).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import Header, Response, status
from fastapi.responses import FileResponse
from sqlalchemy.orm import Session

from server.deps import CurrentDevice, SessionDep, StoreDep
from server.models import Adapter, Device, Program
from server.routes.base import Router
from server.routes.errors import not_found
from server.routes.leases import device_job
from server.store import ArtifactStore
from shared.manifest import ProgramManifest

router = Router(prefix="/v1/jobs/{job_id}", tags=["programs"])

_FILE = {200: {"content": {"application/octet-stream": {}}, "description": "the file (or the requested range)"}}
IfNoneMatch = Header(None, description="a quoted sha256 the client already has")


def serve_file(
    path: Path, sha256: str, filename: str, if_none_match: str | None, media_type: str = "application/octet-stream"
) -> Response:
    """The file with ETag = its sha256; 304 when the client already has exactly these bytes."""
    etag = f'"{sha256}"'
    if if_none_match is not None and etag in [t.strip() for t in if_none_match.split(",")]:
        return Response(status_code=status.HTTP_304_NOT_MODIFIED, headers={"ETag": etag})
    return FileResponse(path, filename=filename, media_type=media_type, headers={"ETag": etag})


def _program_file(session: Session, store: ArtifactStore, device: Device, job_id: int, entry: str) -> tuple[Path, str]:
    """(path, sha256) of the manifest's ``entry`` (pte, ptd, tokenizer) for a job of the device's user."""
    job = device_job(session, device, job_id)
    if job.program_id is None:
        raise not_found("program of job", job_id)
    program = session.get_one(Program, job.program_id)
    session.commit()  # end the transaction (and record last_seen_at) before streaming
    file = getattr(ProgramManifest.model_validate(program.manifest), entry)
    return (store.program(program.key) if entry == "pte" else store.blob(file.file)), file.sha256


@router.get("/program", response_class=FileResponse, responses=_FILE)
def program_file(
    job_id: int, device: CurrentDevice, session: SessionDep, store: StoreDep, if_none_match: str | None = IfNoneMatch
) -> Response:
    path, sha256 = _program_file(session, store, device, job_id, "pte")
    return serve_file(path, sha256, "program.pte", if_none_match)


@router.get("/weights", response_class=FileResponse, responses=_FILE)
def weights_file(
    job_id: int, device: CurrentDevice, session: SessionDep, store: StoreDep, if_none_match: str | None = IfNoneMatch
) -> Response:
    path, sha256 = _program_file(session, store, device, job_id, "ptd")
    return serve_file(path, sha256, path.name, if_none_match)


@router.get("/tokenizer", response_class=FileResponse, responses=_FILE)
def tokenizer_file(
    job_id: int, device: CurrentDevice, session: SessionDep, store: StoreDep, if_none_match: str | None = IfNoneMatch
) -> Response:
    path, sha256 = _program_file(session, store, device, job_id, "tokenizer")
    return serve_file(path, sha256, "tokenizer.json", if_none_match, "application/json")


@router.get("/init", response_class=FileResponse, responses=_FILE)
def init_file(
    job_id: int, device: CurrentDevice, session: SessionDep, store: StoreDep, if_none_match: str | None = IfNoneMatch
) -> Response:
    """The starting adapter's B as safetensors ``{"b_flat": [D]}``: set it with ``set_lora_b`` before step 1."""
    job = device_job(session, device, job_id)
    if job.init_adapter_id is None:
        raise not_found("starting adapter of job", job_id)
    b_sha = session.get_one(Adapter, job.init_adapter_id).b_sha256
    session.commit()
    return serve_file(store.adapter_b(b_sha), b_sha, "init.safetensors", if_none_match)
