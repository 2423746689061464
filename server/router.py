"""``Router``: an ``APIRouter`` whose endpoints leave no write open behind them.

A request's session reads in autocommit and writes only inside the state layer's transitions, each of which
commits itself (``server.db``). FastAPI validates a sync endpoint's response in another thread-pool call and closes
the session later still; a write transaction left open across those hand-offs would hold SQLite's write lock while
waiting for a free thread. So each endpoint is wrapped: in its own thread, an error rolls back whatever is open,
and an endpoint that returns with a unit of work still open is a bug, refused (rolled back, 500) rather than
committed by accident.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, HTTPException, status
from sqlalchemy.orm import Session

from server.db import discard, writing


class WriteLeftOpen(RuntimeError):
    """An endpoint returned inside a unit of work: a transition did not commit."""


def _ends_transaction(endpoint: Callable[..., Any]) -> Callable[..., Any]:
    if "session" not in inspect.signature(endpoint).parameters or inspect.iscoroutinefunction(endpoint):
        return endpoint

    @functools.wraps(endpoint)
    def run(*args: Any, **kwargs: Any) -> Any:
        session: Session = kwargs["session"]
        try:
            result = endpoint(*args, **kwargs)
        except BaseException:
            discard(session)
            raise
        if writing(session):
            discard(session)
            raise WriteLeftOpen(f"{endpoint.__name__} returned with a write uncommitted (rolled back)")
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
