"""``Router``: an ``APIRouter`` whose endpoints end their database transaction before they return.

FastAPI validates a sync endpoint's response in another thread-pool call, and closes the session later still. A
transaction left open across those hand-offs would keep SQLite's write lock (every SQLite transaction here takes
it, see ``server.db``) while waiting for a free thread, and under load all threads may be waiting for that lock.
So each endpoint is wrapped: in the endpoint's own thread, success commits whatever is still open and an error
rolls it back. Endpoints still commit their own writes where the order matters; this only closes the door.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, HTTPException, status
from sqlalchemy.orm import Session


def _ends_transaction(endpoint: Callable[..., Any]) -> Callable[..., Any]:
    if "session" not in inspect.signature(endpoint).parameters or inspect.iscoroutinefunction(endpoint):
        return endpoint

    @functools.wraps(endpoint)
    def run(*args: Any, **kwargs: Any) -> Any:
        session: Session = kwargs["session"]
        try:
            result = endpoint(*args, **kwargs)
        except BaseException:
            session.rollback()
            raise
        session.commit()
        return result

    return run


class Router(APIRouter):
    def add_api_route(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        super().add_api_route(path, _ends_transaction(endpoint), **kwargs)

    def retire(self, paths: tuple[str, ...], method: str, message: str) -> None:
        """Routes of an earlier version answer 410 Gone with ``message`` (what replaced them): the client is older
        than the server. Not in the OpenAPI document."""

        def retired() -> None:
            raise HTTPException(status.HTTP_410_GONE, message)

        for path in paths:
            self.add_api_route(
                path, retired, methods=[method], include_in_schema=False, status_code=status.HTTP_410_GONE
            )
