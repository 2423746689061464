"""``/metrics`` against a client that makes up what it sends: requests with methods the HTTP parser accepts but no
route serves make no series of their own, and the metrics port answers ``/metrics`` and nothing else. Against
``mobizo server`` in its own process, its real HTTP parser in front."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.metrics import METHODS
from tests.security.servers import LiveServer, live_server, send
from tests.server.live import free_port

# Methods httptools' parser (llhttp) accepts: WebDAV's, the CalDAV and UPnP ones, and a few more. The parser answers
# 400 to a token it does not know, so that these are what an unauthenticated client can put in a label.
MADE_UP = ("PROPFIND", "PROPPATCH", "MKCOL", "COPY", "MOVE", "LOCK", "UNLOCK", "SEARCH", "PURGE", "LINK", "UNLINK")
MORE = ("REPORT", "MKACTIVITY", "CHECKOUT", "MERGE", "NOTIFY", "SUBSCRIBE", "UNSUBSCRIBE", "MKCALENDAR", "ACL")
PATHS = ("/healthz", "/v1/jobs", "/no/such/path")


@pytest.fixture(scope="module")
def metered(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, int]]:
    port = free_port()
    with live_server(tmp_path_factory.mktemp("metered"), MOBIZO_METRICS_PORT=str(port)) as server:
        yield server, port


def request_series(port: int) -> set[tuple[str, str, str]]:
    """(method, route, status) of every ``mobizo_http_requests_total`` series, scraped on the metrics port."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {
        (s.labels["method"], s.labels["route"], s.labels["status"])
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "mobizo_http_requests_total"
    }


def send_all(url: str, methods: tuple[str, ...]) -> list[int]:
    return [send(url, m, p, {"Content-Length": "0"}, []).status for m in methods for p in PATHS]


def test_made_up_methods_make_no_new_series(metered: tuple[LiveServer, int]) -> None:
    server, port = metered
    answered = send_all(server.url, MADE_UP)
    assert set(answered) <= {404, 405}, answered  # the app answered them (a 400 would be the parser's)
    first = request_series(port)
    assert {method for method, _, _ in first} <= METHODS | {"other"}, first
    assert any(method == "other" for method, _, _ in first)

    assert set(send_all(server.url, MORE)) <= {404, 405}
    assert request_series(port) == first  # nine more methods on the same paths: not one series more


def test_the_metrics_port_answers_only_metrics(metered: tuple[LiveServer, int]) -> None:
    _, port = metered
    assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).status_code == 200
    for path in ("/", "/other", "/metrics/", "/favicon.ico", "/v1/jobs"):
        answer = httpx.get(f"http://127.0.0.1:{port}{path}", timeout=10)
        assert answer.status_code == 404 and "mobizo_" not in answer.text, path
