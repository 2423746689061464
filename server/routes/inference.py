"""On-device inference, for a device's own use and without a lease: the compiled inference program of a model
(and its files), and the B of the device's user's adapters.

``POST /v1/device/inference`` asks for the program of (model, config): 200 with the manifest and downloads once
built, 503 + Retry-After while it compiles (the first request starts the build), 422 when it cannot be built. The
weights it names are the model's one ``.ptd``, shared with its training programs. A device may fetch what its user
may download (their adapters, and those of the cohorts they are in now); any other adapter answers 404, as
everywhere.
"""

from __future__ import annotations

from fastapi import Request, Response, status
from fastapi.responses import FileResponse
from sqlalchemy.orm import Session

from server import federation
from server.deps import CurrentDevice, ObjectId, SessionDep, StoreDep
from server.inference_builds import BuildFailed, InferenceBuilds
from server.model_lookup import registered_model
from server.registry import adapter_public
from server.responses import FILE_RESPONSE, IfNoneMatch, errors, field_error, not_found, serve_file, try_later
from server.router import Router
from server.tables import Adapter, Model
from shared.manifest import InferenceManifest
from shared.schemas import AdapterPublic, FileRef, InferenceCreate, InferencePublic

router = Router(prefix="/v1/device", tags=["inference"])
BUILD_RETRY_S = 5
_KEY = r"^[0-9a-f]{64}$"


def _builds(request: Request) -> InferenceBuilds:
    return request.app.state.inference_builds


@router.post(
    "/inference",
    response_model=InferencePublic,
    responses=errors(
        400,
        401,
        403,
        413,
        422,
        503,
        e503="the program is being compiled (or compiling is paused): retry after Retry-After",
    ),
)
def inference_program(body: InferenceCreate, device: CurrentDevice, session: SessionDep, request: Request):
    """The inference program of ``body.model`` for adapters of ``body.config``'s LoRA layout (lease-free)."""
    model = registered_model(session, body.model, body.config.targets, field="config.targets")
    model_dir, model_sha = model.path, model.sha256
    session.commit()
    try:
        key, manifest = _builds(request).get(model_dir, model_sha, body.config.model_dump(mode="json"))
    except BuildFailed as exc:
        raise field_error("config", f"cannot compile this inference program: {exc}") from exc
    if manifest is None:
        raise try_later(status.HTTP_503_SERVICE_UNAVAILABLE, "compiling the inference program", BUILD_RETRY_S)
    parsed = InferenceManifest.model_validate(manifest).for_device()
    base = f"/v1/device/inference/{key}"

    def ref(path: str, file) -> FileRef:
        return FileRef(url=f"{base}/{path}", size=file.size, sha256=file.sha256)

    return InferencePublic(
        key=key,
        manifest=parsed,
        program=ref("program", parsed.pte),
        weights=ref("weights", parsed.ptd),
        tokenizer=ref("tokenizer", parsed.tokenizer),
    )


def _built(request: Request, key: str) -> InferenceManifest:
    from shared.manifest import read_inference_manifest

    pte = _builds(request).pte(key)
    if not pte.is_file():
        raise not_found("inference program")
    return read_inference_manifest(pte)


@router.get(
    "/inference/{key}/{part}", response_class=FileResponse, responses={**FILE_RESPONSE, **errors(401, 403, 404, 422)}
)
def inference_file(
    key: str,
    part: str,
    _: CurrentDevice,
    store: StoreDep,
    request: Request,
    if_none_match: str | None = IfNoneMatch,
) -> Response:
    """``part``: ``program`` (the .pte), ``weights`` (the model's .ptd) or ``tokenizer``."""
    import re

    if not re.match(_KEY, key) or part not in ("program", "weights", "tokenizer"):
        raise not_found("inference file")
    manifest = _built(request, key)
    if part == "program":
        return serve_file(_builds(request).pte(key), manifest.pte.sha256, "inference.pte", if_none_match)
    file = manifest.ptd if part == "weights" else manifest.tokenizer
    media = "application/json" if part == "tokenizer" else "application/octet-stream"
    return serve_file(store.blob(file.file), file.sha256, file.file, if_none_match, media)


def _own_adapter(session: Session, device, adapter_id: int) -> Adapter:
    """An adapter the device's user may download (``federation.visible_adapter``: theirs, or a cohort's they are in
    now); 404 otherwise."""
    adapter = federation.visible_adapter(session, device.user_id, adapter_id)
    if adapter is None:
        raise not_found("adapter")
    return adapter


@router.get("/adapters/{adapter_id}", response_model=AdapterPublic, responses=errors(401, 403, 404, 422))
def adapter(adapter_id: ObjectId, device: CurrentDevice, session: SessionDep) -> AdapterPublic:
    """An adapter of the device's user: its model and LoRA layout (which inference program runs it) and B's sha256."""
    found = _own_adapter(session, device, adapter_id)
    return adapter_public(session, found, session.get_one(Model, found.model_id).name)


@router.get(
    "/adapters/{adapter_id}/b", response_class=FileResponse, responses={**FILE_RESPONSE, **errors(401, 403, 404, 422)}
)
def adapter_b(
    adapter_id: ObjectId,
    device: CurrentDevice,
    session: SessionDep,
    store: StoreDep,
    if_none_match: str | None = IfNoneMatch,
) -> Response:
    """The adapter's B as safetensors ``{"b_flat": [D]}``: the inference program's ``set_lora_b`` takes it."""
    b_sha = _own_adapter(session, device, adapter_id).b_sha256
    session.commit()
    return serve_file(store.adapter_b(b_sha), b_sha, "b.safetensors", if_none_match)
