"""A lean HTTP/1.1 client for load generation: one keep-alive connection on asyncio streams, JSON in, status and
bytes out.

Why not httpx: its async client spends about 1.2 ms of CPU per request here, about half of what the server spends
answering it. On a 2-core machine whose cores the load generator shares with the server and the database, the
benchmark would mostly measure its own client. This one does only what the lease and heartbeat mix needs (POST, a
``Content-Length`` body, keep-alive) and costs a fraction of that; ``benchmarks/server_load.py`` reports the client's
CPU per request next to the server's figures so that the share is visible.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import urlsplit

TIMEOUT_S = 60.0


class StaleConnection(ConnectionError):
    """The server closed the connection without an answer."""


class HTTPStatusError(Exception):
    """An answer the caller did not expect (``Response.raise_for_status``)."""


class Response:
    def __init__(self, status_code: int, content: bytes, headers: dict[str, str] | None = None) -> None:
        self.status_code, self.content, self.headers = status_code, content, headers or {}

    def json(self) -> Any:
        return json.loads(self.content)

    def raise_for_status(self) -> Response:
        if self.status_code >= 400:
            raise HTTPStatusError(f"HTTP {self.status_code}: {self.content[:200]!r}")
        return self


class Client:
    """``async with Client(url, token) as http: r = await http.post(path, payload)``; reconnects after a close."""

    def __init__(self, url: str, token: str) -> None:
        parts = urlsplit(url)
        self._host, self._port = parts.hostname or "127.0.0.1", parts.port or 80
        self._netloc, self._token = parts.netloc, token
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._close()

    def _close(self) -> None:
        if self._streams is not None:
            self._streams[1].close()
            self._streams = None

    async def post(self, path: str, payload: Any = None, token: str | None = None) -> Response:
        """POST ``payload`` as JSON (``token``: another caller's, on this connection)."""
        body = b"" if payload is None else json.dumps(payload).encode()
        return await self._send("POST", path, body, "application/json", token)

    async def get(self, path: str, token: str | None = None) -> Response:
        """GET ``path`` (``token``: another caller's, on this connection)."""
        return await self._send("GET", path, b"", None, token)

    async def post_files(self, path: str, files: dict[str, bytes], token: str | None = None) -> Response:
        """POST ``files`` (part name → bytes) as multipart/form-data, each part a file of its own name."""
        boundary = "mobizo-loadgen-boundary"
        body = b"".join(
            f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{name}"\r\n'
            f"Content-Type: application/octet-stream\r\n\r\n".encode()
            + content
            + b"\r\n"
            for name, content in files.items()
        )
        body += f"--{boundary}--\r\n".encode()
        return await self._send("POST", path, body, f"multipart/form-data; boundary={boundary}", token)

    async def _send(self, method: str, path: str, body: bytes, content_type: str | None, token: str | None) -> Response:
        head = f"Host: {self._netloc}\r\nAuthorization: Bearer {token or self._token}\r\n"
        head += f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n" if content_type else ""
        request = f"{method} {path} HTTP/1.1\r\n{head}\r\n".encode() + body
        reused = self._streams is not None
        try:
            async with asyncio.timeout(TIMEOUT_S):
                return await self._exchange(request)
        except StaleConnection:
            self._close()
            if not reused:
                raise
        except BaseException:
            self._close()  # a half-read answer would poison the connection's next request
            raise
        # The server had closed the idle keep-alive connection (uvicorn after 5 s) before reading anything: the
        # request never arrived, so it is sent once more on a new connection, as HTTP clients do.
        try:
            async with asyncio.timeout(TIMEOUT_S):
                return await self._exchange(request)
        except BaseException:
            self._close()
            raise

    async def _exchange(self, request: bytes) -> Response:
        if self._streams is None:
            self._streams = await asyncio.open_connection(self._host, self._port)
        reader, writer = self._streams
        writer.write(request)
        try:
            status_line = await reader.readline()
        except ConnectionResetError as exc:
            raise StaleConnection("the server closed the connection") from exc
        if not status_line:
            raise StaleConnection("the server closed the connection")
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if "transfer-encoding" in headers:
            raise ConnectionError("chunked answers are not supported by this client")
        length = int(headers.get("content-length", 0))
        content = await reader.readexactly(length) if length else b""
        if headers.get("connection", "").lower() == "close":
            self._close()
        return Response(int(status_line.split()[1]), content, headers)
