"""On-device inference, for a device's own use and without a lease: the compiled inference program of a model,
and the adapters of the device's user.

``POST /v1/device/inference`` asks for the program of (model, config): 200 with the manifest and its files once
built, 503 + Retry-After while it compiles (the first request starts the build), 429 + Retry-After when this device,
its user or the server already have as many builds running as allowed (``server.inference_builds``), 422 when it
cannot be built. The weights it names are the model's one ``.ptd``, shared with its training programs. ``GET
/v1/device/adapters/{id}`` describes an adapter its user may see (theirs, and those of the cohorts they are in now;
any other answers 404, as everywhere), with B's sha256. Every file, B included, downloads from ``GET
/v1/blobs/{sha256}`` (``server.grants``).
"""

from __future__ import annotations

from fastapi import Request, status

from server import registry
from server.deps import CurrentDevice, ObjectId, SessionDep
from server.grants import blob_ref
from server.inference_builds import BuildFailed, BuildsBusy, InferenceBuilds
from server.model_lookup import registered_model
from server.registry import adapter_public
from server.responses import errors, field_error, not_found, try_later
from server.router import Router
from server.state import programs
from server.tables import Model
from shared.manifest import InferenceManifest, ProgramFile
from shared.schemas import AdapterPublic, FileRef, InferenceCreate, InferencePublic

router = Router(prefix="/v1/device", tags=["inference"])
BUILD_RETRY_S = 5


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
        429,
        503,
        e429="this device, your devices or the server have as many inference programs building as allowed: retry "
        "after Retry-After",
        e503="the program is being compiled (or compiling is paused): retry after Retry-After",
    ),
)
def inference_program(body: InferenceCreate, device: CurrentDevice, session: SessionDep, request: Request):
    """The inference program of ``body.model`` for adapters of ``body.config``'s LoRA layout (lease-free)."""
    model = registered_model(session, body.model, body.config.targets, field="config.targets")
    model_id, model_dir, model_sha = model.id, model.path, model.sha256
    config = body.config.model_dump(mode="json")
    try:
        key, manifest = _builds(request).get(model_dir, model_sha, config, device.id, device.user_id)
    except BuildFailed as exc:
        raise field_error("config", f"cannot compile this inference program: {exc}") from exc
    except BuildsBusy as exc:
        raise try_later(status.HTTP_429_TOO_MANY_REQUESTS, f"{exc}: retry when one is built", BUILD_RETRY_S) from exc
    if manifest is None:
        raise try_later(status.HTTP_503_SERVICE_UNAVAILABLE, "compiling the inference program", BUILD_RETRY_S)
    programs.add_inference_program(session, model_id, key, manifest)  # its files are granted to devices
    parsed = InferenceManifest.model_validate(manifest).for_device()

    def ref(file: ProgramFile) -> FileRef:
        return blob_ref(file.sha256, file.size)

    return InferencePublic(
        key=key,
        manifest=parsed,
        program=ref(parsed.pte),
        weights=ref(parsed.ptd),
        tokenizer=ref(parsed.tokenizer),
    )


@router.get("/adapters/{adapter_id}", response_model=AdapterPublic, responses=errors(401, 403, 404, 422))
def adapter(adapter_id: ObjectId, device: CurrentDevice, session: SessionDep) -> AdapterPublic:
    """An adapter the device's user may see (``registry.visible_adapter``): its model and LoRA layout (which
    inference program runs it) and B's sha256 (download B from ``GET /v1/blobs/{b_sha256}``)."""
    found = registry.visible_adapter(session, device.user_id, adapter_id)
    if found is None:
        raise not_found("adapter")
    return adapter_public(session, found, session.get_one(Model, found.model_id).name)
