"""The client side of the REST API, shared by the user commands (``server.client``) and the device agent
(``device_agent.api``): how a client is built (base URL, bearer token, user agent) and how an error answer is read
(``describe_error``) and raised (``ServerError``). Retrying is ``shared.retry``'s, for both.

Torch-free and server-free: the agent imports it without importing anything of ``server/``.
"""

from __future__ import annotations

import json

import httpx

from shared.errors import MobizoError


class ServerError(httpx.HTTPStatusError, MobizoError):
    """An error answer, its message the server's ``detail`` (``describe_error``).

    An ``httpx.HTTPStatusError``, so retry policies read its status (``shared.retry.is_transient``); a
    ``MobizoError``, so the command line prints it and exits 1.
    """


def client(
    server_url: str,
    token: str | None = None,
    transport: httpx.BaseTransport | None = None,
    timeout: float = 60.0,
    user_agent: str = "mobizo",
) -> httpx.Client:
    """An ``httpx.Client`` for ``server_url`` that sends ``token`` as its bearer token."""
    headers = {"User-Agent": user_agent} | ({"Authorization": f"Bearer {token}"} if token else {})
    return httpx.Client(base_url=server_url.rstrip("/"), headers=headers, timeout=timeout, transport=transport)


def describe_error(status_code: int, body: str) -> str:
    """``HTTP 422: spec.q: ...`` from an error answer's body (FastAPI's ``{"detail": ...}``, or the raw text)."""
    try:
        detail = json.loads(body).get("detail", body)
    except (json.JSONDecodeError, AttributeError):
        detail = body
    if isinstance(detail, list):
        detail = "; ".join(
            f"{'.'.join(str(p) for p in item.get('loc', [])[1:]) or 'request'}: {item.get('msg')}" for item in detail
        )
    return f"HTTP {status_code}: {detail}"


def checked(response: httpx.Response) -> httpx.Response:
    """``response`` when it succeeded; ``ServerError`` carrying the server's detail otherwise (a streamed error
    answer is read first, to decode it)."""
    if response.is_error:
        response.read()
        raise ServerError(
            describe_error(response.status_code, response.text), request=response.request, response=response
        )
    return response
