"""Downloading programs and weights: resumable, verified, and cached by content so each file is fetched once.

A download goes to ``<dest>.part``; an interrupted one resumes with a ``Range`` request (``If-Range`` carries the
expected sha256, which is the server's ETag, so a changed file restarts from zero instead of splicing). The
result is checked against its sha256 (and size) before it is renamed into place, so a file in the cache is
always whole and correct. The cache is addressed by sha256: a model's ``.ptd`` shared by many jobs is fetched once.
One call is one attempt; wrap it in ``shared.retry.call_with_retry`` (each retry resumes).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import httpx

from shared.errors import MobizoError
from shared.files import make_dirs, open_private, sha256_file
from shared.http_client import checked
from shared.retry import RetryPolicy, call_with_retry

_SHA256 = re.compile(r"[0-9a-f]{64}")
_CONTENT_RANGE = re.compile(r"bytes (\d+)-\d+/(?:\d+|\*)")


class IntegrityError(MobizoError):
    """The downloaded bytes are not the file that was promised (sha256 or size differ); the part is deleted."""


def _check_sha256(sha256: str) -> str:
    if not _SHA256.fullmatch(sha256):
        raise MobizoError(f"not a sha256 hex digest: {sha256!r}")
    return sha256


def _resume_offset(response: httpx.Response, offset: int) -> int:
    """Where the body starts in the file: ``offset`` for a matching 206, else 0 (the server sent it all)."""
    if response.status_code != 206:
        return 0
    match = _CONTENT_RANGE.fullmatch(response.headers.get("content-range", ""))
    if not match or int(match.group(1)) != offset:
        raise IntegrityError(f"{response.url}: answered a range that does not start at byte {offset}")
    return offset


def _receive(response: httpx.Response, part: Path, start: int, progress: Callable[[int], None] | None) -> None:
    """Write the body to ``part`` from byte ``start`` on (0: the part is rewritten)."""
    done = start
    with open_private(part, "ab" if start else "wb") as handle:
        for block in response.iter_bytes():  # as received: a dropped connection loses nothing written
            handle.write(block)
            done += len(block)
            if progress is not None:
                progress(done)


def download(
    client: httpx.Client,
    url: str,
    dest: Path,
    sha256: str,
    size: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Fetch ``url`` into ``dest`` (one attempt, resuming any ``dest.part``); ``IntegrityError`` on a bad file."""
    dest = Path(dest)
    _check_sha256(sha256)
    part = dest.with_name(dest.name + ".part")
    offset = part.stat().st_size if part.exists() else 0
    if offset and size is not None and offset >= size:  # nothing left to fetch: the part is whole or wrong
        return _finish(part, dest, url, sha256, size)
    headers = {"Range": f"bytes={offset}-", "If-Range": f'"{sha256}"'} if offset else {}
    with client.stream("GET", url, headers=headers) as response:
        if response.status_code == 416 and offset:  # the part already holds every byte the server has
            return _finish(part, dest, url, sha256, size)
        checked(response)
        _receive(response, part, _resume_offset(response, offset), progress)
    return _finish(part, dest, url, sha256, size)


def _finish(part: Path, dest: Path, url: str, sha256: str, size: int | None) -> Path:
    """Rename a verified part into place; delete a wrong one and raise ``IntegrityError``."""
    got = sha256_file(part)
    actual_size = part.stat().st_size
    if got != sha256 or (size is not None and actual_size != size):
        part.unlink()
        raise IntegrityError(f"{url}: got {actual_size} bytes with sha256 {got}, expected {size} bytes, {sha256}")
    with open(part, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(part, dest)
    return dest


class ContentCache:
    """Verified files under ``root``, named by their sha256 (plus a suffix such as ``.ptd``)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, sha256: str, suffix: str = "") -> Path:
        return self.root / f"{_check_sha256(sha256)}{suffix}"

    def get(self, sha256: str, suffix: str = "") -> Path | None:
        path = self.path(sha256, suffix)
        return path if path.is_file() else None

    def fetch(
        self,
        client: httpx.Client,
        url: str,
        sha256: str,
        suffix: str = "",
        size: int | None = None,
        policy: RetryPolicy | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> Path:
        """The cached file for ``sha256``, downloading it from ``url`` first when it is not here yet."""
        hit = self.get(sha256, suffix)
        if hit is not None:
            return hit
        make_dirs(self.root)
        dest = self.path(sha256, suffix)
        return call_with_retry(policy or RetryPolicy(max_tries=1), download, client, url, dest, sha256, size, progress)
