"""Downloads against a Range-capable fake server: resume, verification, and the content cache."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import httpx
import pytest

from device_agent.download import ContentCache, IntegrityError, download
from shared.errors import MobizoError
from shared.retry import RetryPolicy

BODY = bytes(range(256)) * 5000  # 1.28 MB: several chunks
SHA = hashlib.sha256(BODY).hexdigest()


class FakeServer:
    """Serves BODY at /f with Range support; can cut the first N responses short or ignore Range."""

    def __init__(self, cut_after: int | None = None, cuts: int = 1, honour_range: bool = True) -> None:
        self.requests: list[httpx.Request] = []
        self.cut_after, self.cuts, self.honour_range = cut_after, cuts, honour_range

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        start = 0
        match = re.fullmatch(r"bytes=(\d+)-", request.headers.get("range", ""))
        if match and self.honour_range:
            start = int(match.group(1))
            if start >= len(BODY):
                return httpx.Response(416)
        body = BODY[start:]
        headers = {"ETag": f'"{SHA}"'}
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(BODY) - 1}/{len(BODY)}"
        if self.cut_after is not None and self.cuts > 0:
            self.cuts -= 1
            return httpx.Response(206 if start else 200, headers=headers, content=self._cut(body))
        return httpx.Response(206 if start else 200, headers=headers, content=body)

    def _cut(self, body: bytes):  # noqa: ANN202 - a byte generator that dies mid-stream
        yield body[: self.cut_after]
        raise httpx.ReadError("connection reset")

    def client(self) -> httpx.Client:
        return httpx.Client(transport=httpx.MockTransport(self.handler), base_url="http://server")


def test_whole_download_is_verified_and_renamed(tmp_path: Path) -> None:
    server = FakeServer()
    seen: list[int] = []
    path = download(server.client(), "/f", tmp_path / "f", SHA, len(BODY), progress=seen.append)
    assert path.read_bytes() == BODY
    assert [p.name for p in tmp_path.iterdir()] == ["f"]
    assert seen[-1] == len(BODY)


def test_interrupted_download_resumes_with_range(tmp_path: Path) -> None:
    server = FakeServer(cut_after=300_000)
    with pytest.raises(httpx.ReadError):
        download(server.client(), "/f", tmp_path / "f", SHA, len(BODY))
    assert (tmp_path / "f.part").stat().st_size == 300_000
    download(server.client(), "/f", tmp_path / "f", SHA, len(BODY))
    assert (tmp_path / "f").read_bytes() == BODY
    assert server.requests[1].headers["range"] == "bytes=300000-"
    assert server.requests[1].headers["if-range"] == f'"{SHA}"'


def test_server_ignoring_range_restarts_cleanly(tmp_path: Path) -> None:
    server = FakeServer(cut_after=100_000, honour_range=False)
    with pytest.raises(httpx.ReadError):
        download(server.client(), "/f", tmp_path / "f", SHA, len(BODY))
    download(server.client(), "/f", tmp_path / "f", SHA, len(BODY))
    assert (tmp_path / "f").read_bytes() == BODY


def test_complete_part_is_committed_without_refetching(tmp_path: Path) -> None:
    (tmp_path / "f.part").write_bytes(BODY)
    server = FakeServer()
    download(server.client(), "/f", tmp_path / "f", SHA)  # size unknown: the server answers 416
    assert (tmp_path / "f").read_bytes() == BODY
    assert [r.headers["range"] for r in server.requests] == [f"bytes={len(BODY)}-"]


def test_wrong_content_is_deleted(tmp_path: Path) -> None:
    wrong = hashlib.sha256(b"other").hexdigest()
    with pytest.raises(IntegrityError, match="sha256"):
        download(FakeServer().client(), "/f", tmp_path / "f", wrong)
    assert list(tmp_path.iterdir()) == []


def test_cache_fetches_once_and_retries_by_resuming(tmp_path: Path) -> None:
    server = FakeServer(cut_after=500_000, cuts=2)
    cache = ContentCache(tmp_path / "cache")
    policy = RetryPolicy(max_tries=5, sleep=lambda s: None)
    path = cache.fetch(server.client(), "/f", SHA, ".ptd", len(BODY), policy=policy)
    assert path == tmp_path / "cache" / f"{SHA}.ptd" and path.read_bytes() == BODY
    assert [r.headers.get("range") for r in server.requests] == [None, "bytes=500000-", "bytes=1000000-"]
    assert cache.fetch(server.client(), "/f", SHA, ".ptd", len(BODY)) == path
    assert len(server.requests) == 3  # the second fetch was a cache hit


def test_digest_must_be_a_sha256(tmp_path: Path) -> None:
    with pytest.raises(MobizoError, match="sha256"):
        ContentCache(tmp_path).path("../../etc/passwd")
