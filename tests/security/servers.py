"""Real servers on loopback for the security tests, and a raw HTTP client that can send what httpx will not.

``live_server``: ``mobizo server`` in its own process (its own ``TMPDIR``, so that what it spools can be seen),
with a paused compile queue. ``app_server``: the app in a uvicorn thread with the fake compile queue and an inline
verify pool, for tests that need a leased job with a program (no export). ``send``: one request over a socket,
the body written by a thread while the answer is read, so that an answer sent before the body is read is seen as
it arrives.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import uvicorn

from server.app import create_app
from server.settings import Settings
from tests.server.factories import ADMIN_TOKEN, FakeCompileQueue, InlinePool
from tests.server.live import free_port, server_process


@dataclass
class LiveServer:
    url: str
    data_dir: Path
    system_tmp: Path  # the server process's TMPDIR

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30)


@contextmanager
def live_server(root: Path, **env: str) -> Iterator[LiveServer]:
    data_dir, system_tmp = root / "data", root / "system-tmp"
    system_tmp.mkdir(parents=True)
    settings = {
        "MOBIZO_DATA_DIR": str(data_dir),
        "MOBIZO_ADMIN_TOKEN": ADMIN_TOKEN,
        "MOBIZO_COMPILE_PAUSED": "true",
        "TMPDIR": str(system_tmp),
        **env,
    }
    with server_process(settings, root / "server.log") as url:
        yield LiveServer(url, data_dir, system_tmp)


@contextmanager
def app_server(settings: Settings, queue: FakeCompileQueue) -> Iterator[tuple[str, object]]:
    """(url, app): the app served by uvicorn on a free loopback port in a thread of this process."""
    app = create_app(settings, queue_factory=queue.bind)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    app.state.verify_pool.close()
    app.state.verify_pool = InlinePool()
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(timeout=20)


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    seconds: float  # from the first byte sent to the whole answer read
    sent: int  # bytes of the body handed to the kernel when the answer had been read


def kernel_buffering() -> int:
    """The most bytes of a request body the kernel can hold between a loopback client and a server that reads none
    of it: the client's largest send buffer and the server's largest receive buffer (Linux's ``tcp_wmem`` and
    ``tcp_rmem`` maxima). A client that got its answer having sent more than this, plus what the server's HTTP layer
    reads ahead, was answered after the server read the body."""
    root = Path("/proc/sys/net/ipv4")
    return sum(int((root / name).read_text().split()[2]) for name in ("tcp_wmem", "tcp_rmem"))


def send(
    url: str, method: str, path: str, headers: dict[str, str], body: Iterable[bytes], timeout: float = 30
) -> Answer:
    """Send the request head, then ``body`` chunk by chunk from a thread (stopping quietly when the server closes
    the connection), and read the answer; the caller sets Content-Length or Transfer-Encoding in ``headers``."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=timeout)
    head = f"{method} {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nConnection: close\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    start = time.monotonic()
    sock.sendall(head.encode())

    sent = 0

    def write() -> None:
        nonlocal sent
        try:
            for chunk in body:
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass  # the server answered and closed: what it did not read is not sent

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        answer = _read_answer(sock)
        seconds, sent_then = time.monotonic() - start, sent
    finally:
        sock.close()
        writer.join(timeout=timeout)
    return Answer(answer[0], answer[1], answer[2], seconds, sent_then)


def _read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before an answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1]), headers, body


def zeros(total: int, chunk: int = 1 << 20) -> Iterator[bytes]:
    """``total`` bytes of ``0`` in chunks."""
    for start in range(0, total, chunk):
        yield b"0" * min(chunk, total - start)


def chunked(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """``chunks`` in HTTP/1.1 chunked transfer encoding."""
    for chunk in chunks:
        yield f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    yield b"0\r\n\r\n"
