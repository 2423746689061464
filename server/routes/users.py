"""``POST /v1/users`` (admin): a user and its API key, shown once."""

from __future__ import annotations

from fastapi import HTTPException, status
from sqlalchemy import select

from server.deps import AdminDep, SessionDep
from server.responses import errors
from server.router import Router
from server.security import USER_KEY, hash_secret, make_token, new_secret
from server.tables import User
from shared.schemas import UserCreate, UserCreated

router = Router(prefix="/v1/users", tags=["users"])


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=UserCreated,
    responses=errors(400, 401, 403, 409, 413, 422, e409="a user of that name exists"),
)
def create_user(body: UserCreate, session: SessionDep, _: AdminDep) -> UserCreated:
    if session.scalar(select(User.id).where(User.name == body.name)) is not None:
        raise HTTPException(status.HTTP_409_CONFLICT, "name: a user of this name exists")
    secret = new_secret()
    user = User(name=body.name, key_hash=hash_secret(secret))
    session.add(user)
    session.commit()
    return UserCreated(id=user.id, name=user.name, api_key=make_token(USER_KEY, user.id, secret))
