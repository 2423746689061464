"""The REST client of the user commands (``mobizo users|enroll-code|jobs|adapters|models``), on the shared client
layer (``shared.http_client``, ``shared.retry``) that the device agent uses too.

Reads (GET, downloads) are retried a few times on a transient failure (a dropped connection, 502/503/504, 429);
writes are sent once, since a submit that timed out may still have been taken. Errors come back as
``MobizoError`` (``ServerError`` carries the server's ``detail``, validation errors flattened to ``field: reason``
lines), so the command line prints them and exits 1.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx

from shared import http_client
from shared.errors import MobizoError
from shared.files import atomic_write
from shared.http_client import checked
from shared.retry import Backoff, RetryPolicy, call_with_retry

T = TypeVar("T")
READ_TRIES = 3


class ServerClient:
    def __init__(
        self,
        server: str,
        token: str | None,
        timeout: float = 60.0,
        transport: httpx.BaseTransport | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        self._http = http_client.client(server, token, transport, timeout)
        self._retry = retry or RetryPolicy(backoff=Backoff(base=0.5, cap=4.0), max_tries=READ_TRIES)

    def _call(self, fn: Callable[..., T], *args: Any, retry: bool) -> T:
        """``fn(*args)``, retried when ``retry``; a server it cannot reach is a ``MobizoError``."""
        try:
            return call_with_retry(self._retry, fn, *args) if retry else fn(*args)
        except httpx.TransportError as exc:
            raise MobizoError(f"cannot reach {self._http.base_url}: {exc}") from None

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        def once() -> httpx.Response:
            return checked(self._http.request(method, path, **kwargs))

        return self._call(once, retry=method == "GET")

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params={k: v for k, v in params.items() if v is not None}).json()

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        return self.request("POST", path, json=body if body is not None else {}).json()

    def put(self, path: str, body: dict[str, Any]) -> Any:
        return self.request("PUT", path, json=body).json()

    def download(self, path: str, dest: Path) -> Path:
        """Stream ``path`` into ``dest`` through a temporary file that is renamed when complete."""

        def stream(out) -> None:
            with self._http.stream("GET", path) as response:
                for chunk in checked(response).iter_bytes(1 << 20):
                    out.write(chunk)

        return self._call(atomic_write, dest, stream, retry=True)

    def close(self) -> None:
        self._http.close()
