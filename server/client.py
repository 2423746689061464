"""A small httpx client for the REST API, shared by the ``mobizo users|enroll-code|jobs|adapters`` commands.

Errors come back as ``MobizoError`` carrying the server's ``detail`` (validation errors are flattened to
``field: reason`` lines), so the command line prints them and exits 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from shared.errors import MobizoError
from shared.files import atomic_write
from shared.schemas import describe_error


class ServerClient:
    def __init__(
        self, server: str, token: str | None, timeout: float = 60.0, transport: httpx.BaseTransport | None = None
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=server.rstrip("/"), headers=headers, timeout=timeout, transport=transport)

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise MobizoError(f"cannot reach {self._http.base_url}: {exc}") from None
        if response.status_code >= 400:
            raise MobizoError(describe_error(response.status_code, response.text))
        return response

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params={k: v for k, v in params.items() if v is not None}).json()

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        return self.request("POST", path, json=body if body is not None else {}).json()

    def download(self, path: str, dest: Path) -> Path:
        """Stream ``path`` into ``dest`` through a temporary file that is renamed when complete."""

        def stream(out) -> None:
            with self._http.stream("GET", path) as response:
                if response.status_code >= 400:
                    response.read()
                    raise MobizoError(describe_error(response.status_code, response.text))
                for chunk in response.iter_bytes(1 << 20):
                    out.write(chunk)

        return atomic_write(dest, stream)

    def close(self) -> None:
        self._http.close()
