"""The REST client of the user commands (``mobizo users|enroll-code|jobs|adapters|models``), on the shared client
layer (``shared.http_client``, ``shared.retry``) that the device agent uses too.

Reads (GET, downloads) are retried a few times on a transient failure (a dropped connection, 502/503/504, 429),
after at least the server's Retry-After; a download the server builds first (a merged model) is asked again for as
long as its caller waits (``download(wait_s=...)``). Writes are sent once, since a submit that timed out may still
have been taken. Errors come back as
``MobizoError`` (``ServerError`` carries the server's ``detail``, validation errors flattened to ``field: reason``
lines), so the command line prints them and exits 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import httpx

from shared import http_client
from shared.errors import MobizoError
from shared.files import atomic_write
from shared.http_client import checked
from shared.retry import Backoff, RetryEvent, RetryPolicy, call_with_retry

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

    def _call(self, fn: Callable[..., T], *args: Any, retry: bool, policy: RetryPolicy | None = None) -> T:
        """``fn(*args)``, retried when ``retry`` (by ``policy``, default the client's); a server it cannot reach is a
        ``MobizoError``."""
        try:
            return call_with_retry(policy or self._retry, fn, *args) if retry else fn(*args)
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

    def download(
        self, path: str, dest: Path, wait_s: float | None = None, on_wait: Callable[[RetryEvent], None] | None = None
    ) -> Path:
        """Stream ``path`` into ``dest`` through a temporary file that is renamed when complete. ``wait_s``: while the
        server answers "not yet" (503, 429: each after its Retry-After), ask again for up to that long; ``on_wait``
        hears of each wait."""

        def stream(out) -> None:
            with self._http.stream("GET", path) as response:
                for chunk in checked(response).iter_bytes(1 << 20):
                    out.write(chunk)

        policy = None if wait_s is None else replace(self._retry, max_tries=None, max_time=wait_s, on_retry=on_wait)
        return self._call(atomic_write, dest, stream, retry=True, policy=policy)

    def close(self) -> None:
        self._http.close()
