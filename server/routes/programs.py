"""Downloads for a job's device: the program (``.pte``), base weights (``.ptd``), tokenizer and starting B.

Each answers with ``ETag: "<sha256>"`` and supports ``Range`` (resume) and ``If-Range``; ``If-None-Match`` with
the same sha256 answers 304 (``server.responses.serve_file``). Only devices of the job's user see them (404 for
anyone else).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import Response
from fastapi.responses import FileResponse
from sqlalchemy.orm import Session

from server.deps import DeviceJob, SessionDep, StoreDep
from server.responses import FILE_RESPONSE, IfNoneMatch, errors, not_found, serve_file
from server.router import Router
from server.store import ArtifactStore
from server.tables import Adapter, Job, Program
from shared.manifest import ProgramManifest

router = Router(prefix="/v1/jobs/{job_id}", tags=["programs"], responses=errors(401, 403, 404, 422))


def _program_file(session: Session, store: ArtifactStore, job: Job, entry: str) -> tuple[Path, str]:
    """(path, sha256) of the manifest's ``entry`` (pte, ptd, tokenizer) for a job of the device's user."""
    if job.program_id is None:
        raise not_found("program of job")
    program = session.get_one(Program, job.program_id)
    session.commit()  # end the transaction before streaming
    file = getattr(ProgramManifest.model_validate(program.manifest), entry)
    return (store.program(program.key) if entry == "pte" else store.blob(file.file)), file.sha256


@router.get("/program", response_class=FileResponse, responses=FILE_RESPONSE)
def program_file(
    job: DeviceJob, session: SessionDep, store: StoreDep, if_none_match: str | None = IfNoneMatch
) -> Response:
    path, sha256 = _program_file(session, store, job, "pte")
    return serve_file(path, sha256, "program.pte", if_none_match)


@router.get("/weights", response_class=FileResponse, responses=FILE_RESPONSE)
def weights_file(
    job: DeviceJob, session: SessionDep, store: StoreDep, if_none_match: str | None = IfNoneMatch
) -> Response:
    path, sha256 = _program_file(session, store, job, "ptd")
    return serve_file(path, sha256, path.name, if_none_match)


@router.get("/tokenizer", response_class=FileResponse, responses=FILE_RESPONSE)
def tokenizer_file(
    job: DeviceJob, session: SessionDep, store: StoreDep, if_none_match: str | None = IfNoneMatch
) -> Response:
    path, sha256 = _program_file(session, store, job, "tokenizer")
    return serve_file(path, sha256, "tokenizer.json", if_none_match, "application/json")


@router.get("/init", response_class=FileResponse, responses=FILE_RESPONSE)
def init_file(
    job: DeviceJob, session: SessionDep, store: StoreDep, if_none_match: str | None = IfNoneMatch
) -> Response:
    """The starting adapter's B as safetensors ``{"b_flat": [D]}``: set it with ``set_lora_b`` before step 1."""
    if job.init_adapter_id is None:
        raise not_found("starting adapter of job")
    b_sha = session.get_one(Adapter, job.init_adapter_id).b_sha256
    session.commit()
    return serve_file(store.adapter_b(b_sha), b_sha, "init.safetensors", if_none_match)
