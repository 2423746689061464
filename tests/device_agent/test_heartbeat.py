"""Heartbeats and the device API against a mocked server (``httpx.MockTransport``): progress goes out, a cancel or a
lost lease halts training, a server that is down does not."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from device_agent import api
from device_agent.heartbeat import Heartbeat

EXPIRES = "2030-01-01T00:00:00Z"


def device_api(handler) -> api.DeviceAPI:
    return api.DeviceAPI(api.client("http://server", "dev-token", transport=httpx.MockTransport(handler)))


class Events:
    def __init__(self) -> None:
        self.names: list[str] = []

    def __call__(self, name: str, **fields) -> None:
        self.names.append(name)


def answer(cancelled: bool = False) -> httpx.Response:
    return httpx.Response(
        200, json={"cancelled": cancelled, "status": "cancelled" if cancelled else "running", "expires_at": EXPIRES}
    )


def test_progress_is_sent_with_the_device_token() -> None:
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, request.headers["authorization"], json.loads(request.content)))
        return answer()

    beat = Heartbeat(device_api(handler), 7, 60, Events(), step=3)
    beat.beat()
    beat.progress(4, 2.5)
    time.sleep(0.01)
    assert beat.progress(5, float("nan")) > 0  # steps/s since the first progress of this session
    beat.beat()
    assert seen[0] == (
        "/v1/work/job-7/heartbeat",
        "Bearer dev-token",
        {"step": 3, "loss": None, "steps_per_s": None, "paused": False},
    )
    assert seen[1][2]["step"] == 5 and seen[1][2]["loss"] is None and seen[1][2]["steps_per_s"] > 0
    assert not beat.halted


def test_cancellation_halts() -> None:
    events = Events()
    beat = Heartbeat(device_api(lambda r: answer(cancelled=True)), 7, 60, events)
    beat.beat()
    assert beat.cancelled.is_set() and beat.halted and "cancelled" in events.names


@pytest.mark.parametrize("status", [404, 409])
def test_lost_lease_halts(status: int) -> None:
    beat = Heartbeat(device_api(lambda r: httpx.Response(status, json={"detail": "lease expired"})), 7, 60, Events())
    beat.beat()
    assert beat.lost.is_set() and not beat.cancelled.is_set()


def test_server_down_is_reported_once_and_survived() -> None:
    up = {"now": False}
    events = Events()

    def handler(request: httpx.Request) -> httpx.Response:
        if not up["now"]:
            raise httpx.ConnectError("connection refused")
        return answer()

    beat = Heartbeat(device_api(handler), 7, 60, events)
    for _ in range(3):
        beat.beat()
    up["now"] = True
    beat.beat()
    assert events.names == ["heartbeat_failed", "heartbeat_ok"]
    assert not beat.halted


def test_the_thread_beats_until_the_block_ends() -> None:
    count = {"n": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        count["n"] += 1
        return answer()

    with Heartbeat(device_api(handler), 7, 0.02, Events()):
        time.sleep(0.3)
    sent = count["n"]
    time.sleep(0.1)
    assert sent >= 3 and count["n"] == sent


def test_lease_204_is_no_work_with_the_servers_wait_and_the_request_says_what_the_device_can_run() -> None:
    from device_agent.api import NoWork

    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(204, headers={"Retry-After": "120"} if len(bodies) == 2 else {})

    from shared.schemas import CpuReport

    assert device_api(handler).lease("adb", 2048) == NoWork(0.0)
    cpu = CpuReport(arch="aarch64", features=["asimd", "dotprod"])
    assert device_api(handler).lease("adb", 2048, True, cpu) == NoWork(120.0)
    assert bodies == [
        {"backend": "adb", "memory_mb": 2048, "eligible": None, "cpu": None},
        {
            "backend": "adb",
            "memory_mb": 2048,
            "eligible": True,
            "cpu": {"arch": "aarch64", "features": ["asimd", "dotprod"]},
        },
    ]


def test_errors_carry_the_servers_detail() -> None:
    handler = lambda r: httpx.Response(422, json={"detail": "log: step 3 is not finite"})  # noqa: E731
    with pytest.raises(httpx.HTTPStatusError, match="HTTP 422: log: step 3 is not finite"):
        device_api(handler).upload(1, b"b", b"log", b"{}")


def test_upload_sends_exactly_three_parts() -> None:
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["type"] = request.headers["content-type"]
        seen["body"] = request.read()
        return httpx.Response(201, json={"adapter_id": 3, "version": 2})

    result = device_api(handler).upload(9, b"B-BYTES", b"LOG-BYTES", b'{"m": 1}')
    assert (result.adapter_id, result.version) == (3, 2)
    assert seen["type"].startswith("multipart/form-data")
    names = [part.split(b'"')[1] for part in seen["body"].split(b"; name=")[1:]]
    assert names == [b"b_flat", b"log", b"metrics"]
    assert b"B-BYTES" in seen["body"] and b"LOG-BYTES" in seen["body"]


def test_no_beat_follows_the_call_that_ended_the_lease() -> None:
    """Once the upload is taken the server answers beats 409; that must not read as a lost lease, so none is sent."""
    paths = []

    def handler(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.path)
        return httpx.Response(409, json={"detail": "job 7: this device does not hold its lease (expired?)"})

    events = Events()
    beat = Heartbeat(device_api(handler), 7, 60, events)
    assert beat.last_call(lambda x: x * 2, 21) == 42
    beat.beat()
    assert paths == [] and events.names == [] and not beat.halted


def test_a_failed_last_call_leaves_the_beats_going() -> None:
    beat = Heartbeat(device_api(lambda r: answer()), 7, 60, Events())

    def refused() -> None:
        raise httpx.ConnectError("connection refused")

    with pytest.raises(httpx.ConnectError):
        beat.last_call(refused)
    sent = []
    beat.api = device_api(lambda r: sent.append(r) or answer())
    beat.beat()
    assert len(sent) == 1
