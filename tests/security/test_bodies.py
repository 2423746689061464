"""Issue 9 defect 1: a large JSON body cost the server 30 s and 750 MB before any authentication, and the 422
echoed it back. Now bodies are capped per endpoint before they are read, and errors never echo input."""

from __future__ import annotations

import json
import threading

import httpx

from server.limits import ENROLL_LIMIT, JSON_LIMIT
from tests.security.servers import chunked, send, zeros

JSON = {"Content-Type": "application/json"}
BIG = 30_000_000  # the reproduction's 30 MB array


def test_30mb_enrollment_body_answers_413_at_once_and_healthz_is_not_delayed(live):
    timings = {}

    def healthz_meanwhile() -> None:
        with httpx.Client(base_url=live.url, timeout=10) as client:
            response = client.get("/healthz")
            timings["healthz"] = response.elapsed.total_seconds(), response.status_code

    probe = threading.Thread(target=healthz_meanwhile)
    body = (b"[" + chunk for chunk in zeros(BIG))  # not JSON, and never read
    headers = {**JSON, "Content-Length": str(BIG + BIG // (1 << 20) + 1)}
    probe.start()
    answer = send(live.url, "POST", "/v1/devices", headers, body)
    probe.join()
    assert answer.status == 413 and answer.seconds < 1.0
    assert len(answer.body) < 200 and b"0000" not in answer.body
    assert timings["healthz"][1] == 200 and timings["healthz"][0] < 1.0


def test_enrollment_body_is_capped_at_a_few_kilobytes(live):
    with live.client() as client:
        small = client.post("/v1/devices", json={"code": "ABCD-EFGH-JKLM", "name": "x" * 100})
        large = client.post("/v1/devices", json={"code": "ABCD-EFGH-JKLM", "name": "x" * ENROLL_LIMIT})
    assert small.status_code == 401  # a well-formed guess is read, and refused
    assert large.status_code == 413 and "x" * 100 not in large.text


def test_chunked_body_without_content_length_is_counted(live):
    headers = {**JSON, "Transfer-Encoding": "chunked"}
    answer = send(live.url, "POST", "/v1/devices", headers, chunked(zeros(4 * 1024 * 1024, 64 * 1024)))
    assert answer.status == 413 and answer.seconds < 2.0
    assert json.loads(answer.body)["detail"].startswith("request body over the limit")


def test_authenticated_json_endpoints_cap_their_bodies_before_the_token_is_checked(live):
    body = json.dumps([0] * (JSON_LIMIT // 2 + 1000)).encode()  # over the limit
    assert len(body) > JSON_LIMIT
    for path in ("/v1/jobs", "/v1/users", "/v1/leases", "/v1/work/job-1/heartbeat", "/v1/jobs/1/cancel"):
        answer = send(live.url, "POST", path, {**JSON, "Content-Length": str(len(body))}, [body])
        assert answer.status == 413, path
    under = json.dumps([0] * 1000)
    with live.client() as client:
        assert client.post("/v1/jobs", content=under, headers=JSON).status_code == 401  # the token, not the body


def test_validation_errors_name_the_field_but_never_echo_the_input(live):
    body = {"code": "SECRET-CODE-ECHO", "name": "", "memory_mb": "plenty-of-memory", "backend": "quantum-backend"}
    with live.client() as client:
        response = client.post("/v1/devices", json=body)
        bad_json = client.post("/v1/devices", content=b'{"code": "SECRET-CODE-ECHO", ', headers=JSON)
    assert response.status_code == 422 and bad_json.status_code == 422
    for answer in (response, bad_json):
        assert "SECRET" not in answer.text and "plenty" not in answer.text and "quantum" not in answer.text
        assert all(set(item) == {"loc", "msg", "type"} for item in answer.json()["detail"])
    fields = {tuple(item["loc"]) for item in response.json()["detail"]}
    assert {("body", "name"), ("body", "memory_mb"), ("body", "backend")} <= fields
