"""Program, weights, tokenizer and starting-B downloads: ETag = sha256, Range resume, 304, scoping."""

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


def test_other_users_devices_and_users_cannot_download(client, leased):
    user, _, lease = leased
    bobs_phone = enroll_device(client, create_user(client, "bob"))
    assert client.get(lease["program"]["url"], headers=bobs_phone["headers"]).status_code == 404
    assert client.get(lease["program"]["url"], headers=user).status_code == 403  # users hold no device token


def test_a_job_without_starting_adapter_has_no_init(client, leased):
    _, phone, lease = leased
    assert client.get(f"/v1/jobs/{lease['job_id']}/init", headers=phone["headers"]).status_code == 404


def test_not_yet_compiled_job_has_no_program(client, leased, queue):
    user, phone, _ = leased
    queue.hold = True
    job = submit_job(client, user)
    assert client.get(f"/v1/jobs/{job['id']}/program", headers=phone["headers"]).status_code == 404
