"""The user commands' client: reads are retried on a transient failure, writes are sent once, errors name the
server's reason."""

from __future__ import annotations

import httpx
import pytest

from server.client import ServerClient
from shared.errors import MobizoError
from shared.http_client import ServerError
from shared.retry import RetryPolicy


def scripted(*codes: int) -> tuple[ServerClient, list[str]]:
    """A client whose server answers ``codes`` in turn (then 200), recording each request's method."""
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.method)
        code = codes[len(seen) - 1] if len(seen) <= len(codes) else 200
        return httpx.Response(code, json={"detail": f"answer {len(seen)}"} if code >= 400 else {"ok": True})

    policy = RetryPolicy(max_tries=3, sleep=lambda _: None)
    return ServerClient("http://server", "key", transport=httpx.MockTransport(handler), retry=policy), seen


def test_a_read_is_retried_after_a_transient_error():
    client, seen = scripted(503, 502)
    assert client.get("/v1/jobs") == {"ok": True}
    assert seen == ["GET", "GET", "GET"]


def test_a_write_is_sent_once():
    client, seen = scripted(503)
    with pytest.raises(ServerError, match="HTTP 503: answer 1"):
        client.post("/v1/jobs", {})
    assert seen == ["POST"]


def test_a_final_error_is_a_mobizo_error_with_the_servers_reason():
    client, seen = scripted(404)
    with pytest.raises(MobizoError, match="HTTP 404: answer 1"):
        client.get("/v1/jobs/7")
    assert seen == ["GET"]


def test_an_unreachable_server_is_named():
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    policy = RetryPolicy(max_tries=2, sleep=lambda _: None)
    client = ServerClient("http://server", "key", transport=httpx.MockTransport(refuse), retry=policy)
    with pytest.raises(MobizoError, match="cannot reach http://server"):
        client.get("/v1/jobs")
