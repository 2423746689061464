"""Every refusal of an upload is paced and closes its connection, a lapsed lease's 409 as much as a 429.

Refusals that came at once and kept the connection let six devices replaying refused uploads (3,293 refusals in
20 s) slow another tenant's requests 2.5-3.8x at the 95th percentile.
"""

from __future__ import annotations

import time

import pytest

from tests.security.conftest import leased_world
from tests.security.servers import send, zeros
from tests.security.test_upload_slots import _head


def _refused(world, device: str, job_id: int):
    headers = {
        **world[device]["headers"],
        "Content-Type": "multipart/form-data; boundary=x",
        "Content-Length": str(100_000),
    }
    return send(world["url"], "POST", f"/v1/work/job-{job_id}/result", headers, zeros(100_000))


DELAY_S = 0.5  # the suite's servers pause 50 ms (tests/conftest.py): these tests pace at a pause of their own


@pytest.fixture
def world(tmp_path):
    with leased_world(tmp_path, upload_refusal_delay_s=DELAY_S) as world:
        yield world


def test_a_409_for_a_lease_the_device_does_not_hold_is_paced_and_closes(world):
    delay = world["app"].state.settings.upload_refusal_delay_s
    assert delay == DELAY_S
    answer = _refused(world, "tablet", world["job"]["id"])  # the phone holds the lease
    assert answer.status == 409 and b"holds no lease" in answer.body
    assert answer.headers["connection"] == "close" and answer.seconds >= delay


def test_a_404_for_another_job_is_paced_and_closes(world):
    answer = _refused(world, "phone", world["job"]["id"] + 1000)
    assert answer.status == 404 and answer.headers["connection"] == "close"
    assert answer.seconds >= world["app"].state.settings.upload_refusal_delay_s


def test_a_body_paced_just_above_the_minimum_rate_is_cut_at_the_longest_upload(tmp_path):
    """100 bytes every 0.2 s keep well above 100 bytes/s, but the whole body may take 1.5 s at most: 408."""
    total = 100_000
    multipart, start = _head(total)

    def trickle():
        yield start
        for _ in range(total // 100):
            yield b"0" * 100
            time.sleep(0.2)

    with leased_world(tmp_path, upload_min_bytes_per_s=100.0, upload_max_body_s=1.5) as world:
        headers = {**world["phone"]["headers"], **multipart}
        answer = send(world["url"], "POST", f"/v1/work/job-{world['job']['id']}/result", headers, trickle())
    assert answer.status == 408 and b"within 1.5 s" in answer.body, answer.body
    assert answer.sent < total // 10
