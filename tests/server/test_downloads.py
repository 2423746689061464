"""Downloads by content (``GET /v1/blobs/{sha256}``): ETag = sha256, Range resume, 304, and who is granted what."""

from __future__ import annotations

import hashlib

import pytest

from tests.server.factories import create_user, enroll_device, make_fake_model, register_model, submit_job


@pytest.fixture
def leased(client, tmp_path):
    register_model(client, make_fake_model(tmp_path / "model"))
    user = create_user(client)
    phone = enroll_device(client, user)
    submit_job(client, user)
    return user, phone, client.post("/v1/leases", headers=phone["headers"]).json()


@pytest.mark.parametrize("entry", ["program", "weights", "tokenizer"])
def test_file_matches_its_sha256_and_etag(client, leased, entry):
    _, phone, lease = leased
    r = client.get(lease[entry]["url"], headers=phone["headers"])
    assert r.status_code == 200
    assert hashlib.sha256(r.content).hexdigest() == lease[entry]["sha256"] and len(r.content) == lease[entry]["size"]
    assert r.headers["etag"] == f'"{lease[entry]["sha256"]}"'


def test_range_resumes_and_if_none_match_is_304(client, leased):
    _, phone, lease = leased
    url, sha = lease["weights"]["url"], lease["weights"]["sha256"]
    whole = client.get(url, headers=phone["headers"]).content
    part = client.get(url, headers={**phone["headers"], "Range": "bytes=100-", "If-Range": f'"{sha}"'})
    assert part.status_code == 206 and part.content == whole[100:]
    stale = client.get(url, headers={**phone["headers"], "Range": "bytes=100-", "If-Range": '"0000"'})
    assert stale.status_code == 200 and stale.content == whole  # changed file: start over
    assert client.get(url, headers={**phone["headers"], "If-None-Match": f'"{sha}"'}).status_code == 304
    for matching in ("*", f'"0000", W/"{sha}"'):  # any representation; a weak tag compares as its strong one
        assert client.get(url, headers={**phone["headers"], "If-None-Match": matching}).status_code == 304
    assert client.get(url, headers={**phone["headers"], "If-None-Match": '"0000"'}).status_code == 200
    past = client.get(url, headers={**phone["headers"], "Range": f"bytes={len(whole) + 10}-"})
    malformed = client.get(url, headers={**phone["headers"], "Range": "bytes=abc"})
    responses = client.get("/openapi.json").json()["paths"]["/v1/blobs/{sha256}"]["get"]["responses"]
    assert past.status_code == 416 and past.headers["content-range"] == f"bytes */{len(whole)}"
    assert malformed.status_code == 400 and "Range" in malformed.json()["detail"]  # JSON, as every 4xx
    for answer in (part, past, malformed):  # every status the route answers is in its OpenAPI document
        assert str(answer.status_code) in responses, answer.status_code


def test_other_users_devices_and_users_cannot_download(client, leased):
    user, _, lease = leased
    bobs_phone = enroll_device(client, create_user(client, "bob"))
    assert client.get(lease["program"]["url"], headers=bobs_phone["headers"]).status_code == 404
    assert client.get(lease["program"]["url"], headers=user).status_code == 403  # users hold no device token


def test_a_job_without_starting_adapter_has_no_init(client, leased):
    assert leased[2]["init"] is None


def test_every_file_is_named_by_content(client, leased):
    lease = leased[2]
    for entry in ("program", "weights", "tokenizer"):
        assert lease[entry]["url"] == f"/v1/blobs/{lease[entry]['sha256']}"


def test_only_the_device_holding_the_work_may_download_its_program(client, leased):
    user, phone, lease = leased
    tablet = enroll_device(client, user, "tablet")  # the same user's, but it holds no lease
    for entry in ("program", "weights", "tokenizer"):
        assert client.get(lease[entry]["url"], headers=tablet["headers"]).status_code == 404
    assert client.post(f"/v1/jobs/{lease['job_id']}/cancel", headers=user).status_code == 200
    refused = client.get(lease["program"]["url"], headers=phone["headers"])  # its lease is over
    assert refused.status_code == 404 and refused.json()["detail"] == "file not found"


def test_unknown_and_malformed_sha256(client, leased):
    _, phone, _ = leased
    assert client.get(f"/v1/blobs/{'0' * 64}", headers=phone["headers"]).status_code == 404
    assert client.get(f"/v1/blobs/{'A' * 64}", headers=phone["headers"]).status_code == 422
    assert client.get("/v1/blobs/abc", headers=phone["headers"]).status_code == 422


@pytest.mark.parametrize(
    "path",
    [
        "/v1/jobs/1/program",
        "/v1/jobs/1/init",
        "/v1/round-clients/1/weights",
        "/v1/device/inference/k/program",
        "/v1/device/adapters/1/b",
    ],
)
def test_an_agent_of_the_previous_version_is_told_to_upgrade(client, leased, path):
    refused = client.get(path, headers=leased[1]["headers"])
    assert refused.status_code == 410 and "upgrade the device agent" in refused.json()["detail"]
