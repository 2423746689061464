"""benchmarks/loadgen.py, the benchmark's lean HTTP client, against a socket server on loopback: it reads each
answer whole (so keep-alive requests do not mix), sends the token and JSON body, and reconnects after a close."""

from __future__ import annotations

import asyncio
import json

import pytest

from benchmarks import loadgen


async def _serve(requests: list[dict], answers: list[bytes]) -> asyncio.Server:
    """Answers each request with the next of ``answers``; records the request line, headers and body."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while answers and (line := await reader.readline()):
            headers = {}
            while (header := await reader.readline()) != b"\r\n":
                name, _, value = header.decode().partition(":")
                headers[name.lower()] = value.strip()
            body = await reader.readexactly(int(headers["content-length"]))
            requests.append({"line": line.decode().strip(), "headers": headers, "body": body})
            answer = answers.pop(0)
            writer.write(answer)
            await writer.drain()
            if b"Connection: close" in answer:
                break
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def _answer(status: str, body: bytes = b"", close: bool = False) -> bytes:
    extra = "Connection: close\r\n" if close else ""
    return f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


def test_keep_alive_answers_close_and_errors() -> None:
    async def run() -> tuple[list, list]:
        requests: list[dict] = []
        answers = [
            _answer("200 OK", b'{"job_id": 7}'),
            _answer("204 No Content"),
            _answer("409 Conflict", b'{"detail": "lost"}', close=True),
            _answer("200 OK", b"{}"),
        ]
        server = await _serve(requests, answers)
        port = server.sockets[0].getsockname()[1]
        got = []
        async with loadgen.Client(f"http://127.0.0.1:{port}", "tok") as http:
            got.append((await http.post("/v1/leases")).raise_for_status().json())
            got.append((await http.post("/v1/work/job-7/heartbeat", {"step": 1})).status_code)
            with pytest.raises(loadgen.HTTPStatusError, match="409"):
                (await http.post("/v1/work/job-7/heartbeat", {"step": 2})).raise_for_status()
            got.append((await http.post("/v1/leases")).json())  # after the server closed: a new connection
        server.close()
        await server.wait_closed()
        return requests, got

    requests, got = asyncio.run(run())
    assert got == [{"job_id": 7}, 204, {}]
    assert [r["line"] for r in requests] == [
        "POST /v1/leases HTTP/1.1",
        "POST /v1/work/job-7/heartbeat HTTP/1.1",
        "POST /v1/work/job-7/heartbeat HTTP/1.1",
        "POST /v1/leases HTTP/1.1",
    ]
    assert all(r["headers"]["authorization"] == "Bearer tok" for r in requests)
    assert json.loads(requests[1]["body"]) == {"step": 1} and requests[0]["body"] == b""
