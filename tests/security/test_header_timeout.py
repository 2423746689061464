"""Slow heads (server.http_protocol): a connection that does not send a whole request head within
``MOBIZO_HEADER_TIMEOUT_S`` of opening, or of its previous answer, is closed by the server; a head sent in time is
answered. uvicorn alone keeps all three connections below open for as long as the client likes."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

from tests.security.servers import live_server

TIMEOUT_S = 1  # the server's head deadline in this test


def _answer(sock: socket.socket) -> bytes:
    """One whole answer with a Content-Length (what /healthz sends)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    while len(body) < length:
        body += sock.recv(4096)
    return head


def _closed_by_server(sock: socket.socket) -> bool:
    """True once the server closes (EOF or reset), False if it still holds the connection after 10 s."""
    sock.settimeout(10)
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_connection_without_a_whole_head_in_time_is_closed(tmp_path):
    with live_server(tmp_path, MOBIZO_HEADER_TIMEOUT_S=str(TIMEOUT_S)) as server:
        address = urlsplit(server.url)
        connect = lambda: socket.create_connection((address.hostname, address.port), timeout=10)  # noqa: E731
        head = f"GET /healthz HTTP/1.1\r\nHost: {address.netloc}\r\n".encode()
        opened = time.monotonic()
        silent, partial, kept = connect(), connect(), connect()
        partial.sendall(head)  # the request line and one header, never the blank line that ends the head
        kept.sendall(head + b"\r\n")
        assert _answer(kept).startswith(b"HTTP/1.1 200")  # in time: answered, and the connection kept alive
        kept.sendall(head)  # the next request's head, half sent
        for name, sock in (("silent", silent), ("partial", partial), ("kept", kept)):
            with sock:
                assert _closed_by_server(sock), f"the {name} connection was still open after 10 s"
        assert time.monotonic() - opened < 10 * TIMEOUT_S
        with connect() as fresh:  # the server still answers
            fresh.sendall(head + b"\r\n")
            assert _answer(fresh).startswith(b"HTTP/1.1 200")
