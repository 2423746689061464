"""The adapter registry of the calling user: list, show, download (a PEFT archive, A included). A user sees their
own adapters and those of the cohorts they are in now (a cohort's adapter is the cohort's, not a user's)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import Query, Response, status
from fastapi.responses import FileResponse

from server import queries
from server.deps import CurrentUser, MergedBuildsDep, ObjectId, SessionDep, StoreDep
from server.merged import merge_key, prompts_sha256
from server.merged_builds import RETRY_S, MergeBusy, MergeFailed, MergeTooLarge
from server.registry import adapter_public as public
from server.responses import FILE_RESPONSE, RANGE_ERRORS, IfNoneMatch, errors, field_error, serve_file, try_later
from server.router import Router
from server.tables import Model
from server.views import archive_response, user_adapter
from shared.backends import MERGE_DTYPES, MergeDtype
from shared.schemas import MAX_DB_INT, AdapterPublic, AdaptersPublic
from shared.text_fields import Line

router = Router(prefix="/v1/adapters", tags=["adapters"])


@router.get("", response_model=AdaptersPublic, responses=errors(401, 403, 422))
def list_adapters(
    user: CurrentUser,
    session: SessionDep,
    model: Annotated[Line | None, Query(description="only this model's adapters")] = None,
    task: Annotated[Line | None, Query(description="only this task's adapters")] = None,
    skip: int = Query(0, ge=0, le=MAX_DB_INT),
    limit: int = Query(100, ge=1, le=1000),
) -> AdaptersPublic:
    """The adapters the caller may see, newest first."""
    rows, count = queries.adapters_of(session, user.id, model, task, skip, limit)
    return AdaptersPublic(data=[public(session, adapter, model.name) for adapter, model, *_ in rows], count=count)


@router.get("/{adapter_id}", response_model=AdapterPublic, responses=errors(401, 403, 404, 422))
def show(adapter_id: ObjectId, user: CurrentUser, session: SessionDep) -> AdapterPublic:
    """One adapter: its version, lineage, metrics and held-out figures."""
    adapter = user_adapter(session, user.id, adapter_id)
    return public(session, adapter, session.get_one(Model, adapter.model_id).name)


@router.get(
    "/{adapter_id}/download",
    response_class=FileResponse,
    responses={
        **FILE_RESPONSE,
        200: {"content": {"application/zip": {}}, "description": "a zipped PEFT adapter directory"},
        **errors(400, 401, 403, 404, 416, 422, **RANGE_ERRORS),
    },
)
def download(
    adapter_id: ObjectId,
    user: CurrentUser,
    session: SessionDep,
    store: StoreDep,
    if_none_match: str | None = IfNoneMatch,
) -> Response:
    """A zip that unpacks to a PEFT adapter directory: ``PeftModel.from_pretrained(base, that_dir)``."""
    return archive_response(session, store, user_adapter(session, user.id, adapter_id), if_none_match)


@router.get(
    "/{adapter_id}/merged",
    response_class=FileResponse,
    responses={
        **FILE_RESPONSE,
        200: {"content": {"application/zip": {}}, "description": "a zipped Hugging Face model folder"},
        **errors(
            400,
            401,
            403,
            404,
            416,
            422,
            429,
            503,
            **RANGE_ERRORS,
            e422="dtype is not one of the merge's dtypes, or the merged model in it is larger than the server keeps",
            e429="your downloads, or the server, have as many merges building as allowed: retry after Retry-After",
            e503="the merge is being built (or failed a moment ago): retry after Retry-After",
        ),
    },
)
def merged(
    adapter_id: ObjectId,
    user: CurrentUser,
    session: SessionDep,
    store: StoreDep,
    merges: MergedBuildsDep,
    dtype: Annotated[MergeDtype, Query(description="the merged weights' dtype")] = MERGE_DTYPES[0],
    if_none_match: str | None = IfNoneMatch,
) -> Response:
    """The base model with the adapter folded in (``W + (alpha / r) B A``), a zip of a plain Hugging Face folder
    (safetensors, config, tokenizer) for runtimes without LoRA: ``AutoModelForCausalLM.from_pretrained(that_dir)``.
    Built off the request on the first one (503 + Retry-After until it is), then served from the store, shared by
    every adapter with the same base, B and LoRA layout (``server.merged_builds``)."""
    if dtype not in MERGE_DTYPES:
        raise field_error("dtype", f"choose one of {', '.join(MERGE_DTYPES)}", where="query")
    adapter = user_adapter(session, user.id, adapter_id)
    model = session.get_one(Model, adapter.model_id)
    layout = (adapter.rank, adapter.alpha, adapter.targets, adapter.a_seed)
    key = merge_key(model.sha256, prompts_sha256(Path(model.path)), adapter.b_sha256, *layout, dtype)
    try:
        sha256 = merges.get(session, key, user.id, model.path, adapter.archive_sha256, dtype)
    except MergeTooLarge as exc:
        raise field_error("dtype", str(exc), where="query") from exc
    except MergeBusy as exc:
        raise try_later(status.HTTP_429_TOO_MANY_REQUESTS, f"{exc}: retry when one is built", RETRY_S) from exc
    except MergeFailed as exc:
        detail = f"building the merged model failed: {exc}; it is tried again after Retry-After"
        raise try_later(status.HTTP_503_SERVICE_UNAVAILABLE, detail, exc.retry_after_s) from exc
    if sha256 is None:
        raise try_later(status.HTTP_503_SERVICE_UNAVAILABLE, "building the merged model", RETRY_S)
    filename = f"{model.name}-{adapter.task}-v{adapter.version}-merged-{dtype}.zip"
    return serve_file(store.merged(key), sha256, filename, if_none_match, "application/zip")
