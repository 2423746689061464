"""``GET /v1/blobs/{sha256}``: every file a device downloads, by content, from one route.

A lease names its program, weights, tokenizer and starting B by sha256 (``FileRef.url`` is this route), as do an
inference program (``POST /v1/device/inference``) and an adapter (``GET /v1/device/adapters/{id}``: its
``b_sha256``). The answer is the file with ``ETag: "<sha256>"``, ``Range`` (resume) and ``If-Range``;
``If-None-Match`` with the same sha256 answers 304 (``server.responses.serve_file``). Who may download what is
``server.grants``: the files of the work the device holds, the B of the adapters its user may see, and inference
programs; 404 for anything else.

The download routes of earlier versions (``/v1/jobs/{id}/program`` and the like, ``/v1/round-clients/{id}/init``,
``/v1/device/inference/{key}/{part}``, ``/v1/device/adapters/{id}/b``) answer 410 Gone telling the agent to
upgrade.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Path, Response
from fastapi.responses import FileResponse

from server import grants
from server.deps import CurrentDevice, ProgramManifestsDep, SessionDep, StoreDep
from server.responses import FILE_RESPONSE, RANGE_ERRORS, IfNoneMatch, errors, not_found, serve_file
from server.router import Router
from shared.schemas import BLOBS_PATH

router = Router(tags=["blobs"])
Sha256 = Annotated[str, Path(pattern=r"^[0-9a-f]{64}$", description="the file's sha256, lowercase hex")]


@router.get(
    f"{BLOBS_PATH}/{{sha256}}",
    response_class=FileResponse,
    responses={**FILE_RESPONSE, **errors(400, 401, 403, 404, 416, 422, **RANGE_ERRORS)},
)
def blob(
    sha256: Sha256,
    device: CurrentDevice,
    session: SessionDep,
    store: StoreDep,
    manifests: ProgramManifestsDep,
    if_none_match: str | None = IfNoneMatch,
) -> Response:
    """The file whose content is ``sha256``, if this device was granted it (``server.grants``)."""
    found = grants.granted(session, store, manifests, device, sha256)
    if found is None:
        raise not_found("file")
    return serve_file(found.path, sha256, found.filename, if_none_match, found.media_type)


RETIRED = (
    "/v1/jobs/{job_id}/program",
    "/v1/jobs/{job_id}/weights",
    "/v1/jobs/{job_id}/tokenizer",
    "/v1/jobs/{job_id}/init",
    "/v1/round-clients/{client_id}/program",
    "/v1/round-clients/{client_id}/weights",
    "/v1/round-clients/{client_id}/tokenizer",
    "/v1/round-clients/{client_id}/init",
    "/v1/device/inference/{key}/{part}",
    "/v1/device/adapters/{adapter_id}/b",
)


router.retire(
    RETIRED,
    "GET",
    "this download route was retired: files are fetched by content from GET /v1/blobs/{sha256}; "
    "upgrade the device agent",
)
