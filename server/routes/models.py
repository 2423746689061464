"""``POST /v1/models`` (admin) registers a server-side Hugging Face directory; ``GET /v1/models`` lists them."""

from __future__ import annotations

from pathlib import Path

from fastapi import HTTPException, status

from server import accounts, queries
from server.deps import AdminDep, AnyAuth, SessionDep
from server.responses import errors, field_error
from server.router import Router
from server.tables import Model
from shared.errors import DataError
from shared.model_files import inspect_model
from shared.schemas import ModelCreate, ModelPublic, ModelsPublic

router = Router(prefix="/v1/models", tags=["models"])


def public(model: Model) -> ModelPublic:
    return ModelPublic(
        id=model.id,
        name=model.name,
        sha256=model.sha256,
        architecture=model.architecture,
        modules=sorted({name.rsplit(".", 1)[-1] for name in model.modules}),
        created_at=model.created_at,
    )


def _is_dir(path: Path) -> bool:
    """``Path.is_dir``, also False for a path the system refuses to look up (too long, or with a NUL byte)."""
    try:
        return path.is_dir()
    except (OSError, ValueError):
        return False


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=ModelPublic,
    responses=errors(400, 401, 403, 409, 413, 422, e409="a model of that name exists"),
)
def register_model(body: ModelCreate, _: AdminDep, session: SessionDep) -> ModelPublic:
    """Hashes and inspects the directory (no torch, no loading) before touching the database."""
    path = Path(body.path).expanduser()
    if not _is_dir(path):
        raise field_error("path", "not a directory on the server")
    try:
        sha256, architecture, modules = inspect_model(path)
    except DataError as exc:
        raise field_error("path", str(exc)) from None
    except OSError as exc:  # a file in it unreadable, or its path longer than the system allows (ENAMETOOLONG)
        raise field_error("path", f"the directory's files cannot be read ({exc.strerror or 'error'})") from None
    try:
        model = accounts.register_model(
            session, name=body.name, path=str(path.resolve()), sha256=sha256, architecture=architecture, modules=modules
        )
    except accounts.Taken:
        raise HTTPException(status.HTTP_409_CONFLICT, "name: a model of this name exists") from None
    return public(model)


@router.get("", response_model=ModelsPublic, responses=errors(401))
def list_models(_: AnyAuth, session: SessionDep) -> ModelsPublic:
    """The registered base models."""
    models = queries.models(session)
    return ModelsPublic(data=[public(m) for m in models], count=len(models))
