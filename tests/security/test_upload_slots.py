"""Issue 25 point 1 (and the disconnect of point 6): one user's devices opened every upload slot, sent a head and
~100 body bytes and stalled, and every other tenant's upload answered 429 for as long as they liked; a client that
disconnected mid-upload wrote a ~100-line ERROR traceback. Now slots are bounded per user too and taken only once the
body arrives, a body that misses its pace (``server.uploads.BodyPace``, short here) answers 408 with one WARNING
line and gives its slot back, and so does a client that goes away."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.security.conftest import leased_world
from tests.security.servers import _read_answer
from tests.server.factories import b_flat_bytes, create_user, enroll_device, fake_training, submit_job, upload

TIMEOUT_S = 1.5
BOUNDARY = "mobizo-stall"


@pytest.fixture
def tenants(tmp_path: Path) -> Iterator[dict]:
    """``world`` with 4 slots (2 per device, 2 per user) and a 1.5 s body timeout; mallory has two devices, each
    holding the lease of a job; the phone (another user's) holds the lease of ``job``."""
    settings = {
        "max_uploads": 4,
        "max_uploads_per_device": 2,
        "max_uploads_per_user": 2,
        "upload_body_timeout_s": TIMEOUT_S,
        "upload_min_bytes_per_s": 1e6,  # 100 bytes buy 0.1 ms: the stall is over at ~1.5 s
    }
    with leased_world(tmp_path, **settings) as world:
        http = world["client"]
        mallory = create_user(http, "mallory")
        world["mallory"] = []
        for name in ("m1", "m2"):
            device = enroll_device(http, mallory, name)
            job = submit_job(http, mallory, device_id=device["id"])
            assert http.post("/v1/leases", headers=device["headers"]).json()["job_id"] == job["id"]
            world["mallory"].append((device, job["id"]))
        yield world


@contextmanager
def captured(*names: str) -> Iterator[list[logging.LogRecord]]:
    """The records of loggers ``names`` (uvicorn's do not reach the root logger, so caplog would miss them)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    loggers = [logging.getLogger(name) for name in names]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield records
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def _head(total: int) -> tuple[dict[str, str], bytes]:
    head = f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="log"; filename="log"\r\n\r\n'.encode()
    return {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}", "Content-Length": str(total)}, head


def _open(url: str, device: dict, job_id: int, sent: bytes) -> socket.socket:
    """A connection on which an upload of 100,000 bytes sent its head and ``sent`` of its body, and no more."""
    headers, head = _head(100_000)
    parts = urlsplit(url)
    request = f"POST /v1/work/job-{job_id}/result HTTP/1.1\r\nHost: {parts.netloc}\r\n"
    request += "".join(f"{k}: {v}\r\n" for k, v in (headers | device["headers"]).items()) + "\r\n"
    sock = socket.create_connection((parts.hostname, parts.port), timeout=15)
    sock.sendall(request.encode() + head + sent)
    return sock


def _stalled(url: str, device: dict, job_id: int, answers: list[tuple[int, float]]) -> threading.Thread:
    """An upload that sends its head and 100 body bytes, then nothing: (status, seconds) of its answer."""

    def run() -> None:
        start = time.monotonic()
        with _open(url, device, job_id, b"0" * 100) as sock:
            status = _read_answer(sock)[0]
        answers.append((status, time.monotonic() - start))

    return threading.Thread(target=run)


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_stalled_uploads_of_one_tenant_neither_block_another_nor_keep_their_slots(tenants):
    slots, answers = tenants["app"].state.upload_slots, []
    taken: list[tuple[int, int]] = []  # (device, slots already held) of each slot asked for
    hold = slots.hold

    def recorded_hold(device_id: int, user_id: int):
        taken.append((device_id, slots.held()))
        return hold(device_id, user_id)

    slots.hold = recorded_hold
    b, log = fake_training(tenants["lease"]["spec"], tenants["lease"]["manifest"]["lora_size"])
    stalled = [_stalled(tenants["url"], device, job_id, answers) for device, job_id in tenants["mallory"] for _ in "ab"]
    with captured("server.uploads", "uvicorn.error") as records:
        for thread in stalled:
            thread.start()
        _wait_for(lambda: len(answers) >= 2 and slots.held() == 2, 5, "two stalled uploads holding slots")
        assert sorted(status for status, _ in answers) == [429, 429]  # mallory's third and fourth: 2 per user
        other = upload(tenants["client"], tenants["phone"], tenants["job"]["id"], b_flat_bytes(b), log)
        assert other.status_code == 201, other.text
        for thread in stalled:
            thread.join(timeout=15)
    assert taken[-1] == (tenants["phone"]["id"], 2)  # the other tenant got a slot while mallory's two stalled
    assert sorted(status for status, _ in answers) == [408, 408, 429, 429], answers
    assert all(TIMEOUT_S <= seconds < TIMEOUT_S + 2 for status, seconds in answers if status == 408), answers
    assert slots.held() == 0
    warnings = [r for r in records if r.levelno == logging.WARNING and "did not arrive in time" in r.getMessage()]
    assert len(warnings) == 2 and not [r for r in records if r.levelno >= logging.ERROR]
    assert all(r.exc_info is None for r in warnings)


def test_a_client_that_disconnects_mid_upload_logs_one_warning_and_frees_its_slot(world):
    slots = world["app"].state.upload_slots
    with captured("server.uploads", "uvicorn.error") as records:
        with _open(world["url"], world["phone"], world["job"]["id"], b"0" * 5000):
            _wait_for(lambda: slots.held() == 1, 5, "the upload to hold a slot")
        _wait_for(lambda: slots.held() == 0, 5, "the slot to be given back")
        time.sleep(0.2)  # anything the server logs about it is logged by now
    assert [r.levelname for r in records] == ["WARNING"], [r.getMessage() for r in records]
    assert "disconnected" in records[0].getMessage() and records[0].exc_info is None
    b, log = fake_training(world["lease"]["spec"], world["lease"]["manifest"]["lora_size"])
    response = upload(world["client"], world["phone"], world["job"]["id"], b_flat_bytes(b), log)
    assert response.status_code == 201, response.text  # max_uploads_per_device=1: the slot is free again
