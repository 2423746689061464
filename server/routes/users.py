"""``POST /v1/users`` (admin): a user and its API key, shown once."""

from __future__ import annotations

from fastapi import HTTPException, status

from server import accounts
from server.deps import AdminDep, SessionDep
from server.responses import errors
from server.router import Router
from server.security import USER_KEY, hash_secret, make_token, new_secret
from shared.schemas import UserCreate, UserCreated

router = Router(prefix="/v1/users", tags=["users"])


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=UserCreated,
    responses=errors(400, 401, 403, 409, 413, 422, e409="a user of that name exists"),
)
def create_user(body: UserCreate, session: SessionDep, _: AdminDep) -> UserCreated:
    """Create a user (admin); the answer shows the user's API key once."""
    secret = new_secret()
    try:
        user = accounts.create_user(session, body.name, hash_secret(secret))
    except accounts.Taken:
        raise HTTPException(status.HTTP_409_CONFLICT, "name: a user of this name exists") from None
    return UserCreated(id=user.id, name=user.name, api_key=make_token(USER_KEY, user.id, secret))
