"""On-device inference routes: the lease-free inference program (compiled once, then served from the cache) and
the device's access to its own user's adapters' B."""

from __future__ import annotations

import hashlib
import time

import pytest

from shared.b_file import read_b_file
from tests.server.factories import (
    b_flat_bytes,
    create_user,
    enroll_device,
    leased_job,
    register_model,
    upload,
)


@pytest.fixture
def adapter(client, tmp_path):
    """A user with a trained adapter (fake model, fake compile), a device of theirs, and another user's device."""
    leased = leased_job(client, tmp_path / "model")
    b, phone = leased["b"], leased["phone"]
    adapter_id = upload(client, phone, leased["job"]["id"], b_flat_bytes(b), leased["log"]).json()["adapter_id"]
    bobs_phone = enroll_device(client, create_user(client, "bob"))
    return {"id": adapter_id, "user": leased["user"], "phone": phone, "bob": bobs_phone, "b": b}


def test_device_reads_its_users_adapter_and_b(client, adapter, tmp_path):
    phone, url = adapter["phone"], f"/v1/device/adapters/{adapter['id']}"
    shown = client.get(url, headers=phone["headers"])
    assert shown.status_code == 200
    assert shown.json() == client.get(f"/v1/adapters/{adapter['id']}", headers=adapter["user"]).json()
    b_url = f"/v1/blobs/{shown.json()['b_sha256']}"
    got = client.get(b_url, headers=phone["headers"])  # its job is over: granted as its user's adapter
    assert got.status_code == 200 and hashlib.sha256(got.content).hexdigest() == shown.json()["b_sha256"]
    (tmp_path / "b.safetensors").write_bytes(got.content)
    assert (read_b_file(tmp_path / "b.safetensors", adapter["b"].size) == adapter["b"]).all()
    etag = got.headers["etag"]
    assert client.get(b_url, headers={**phone["headers"], "If-None-Match": etag}).status_code == 304


def test_other_users_devices_and_user_keys_get_no_adapter(client, adapter):
    shown = f"/v1/device/adapters/{adapter['id']}"
    b_url = f"/v1/blobs/{client.get(shown, headers=adapter['phone']['headers']).json()['b_sha256']}"
    for url in (shown, b_url):
        assert client.get(url, headers=adapter["bob"]["headers"]).status_code == 404
        assert client.get(url, headers=adapter["user"]).status_code == 403  # a user key is not a device token
    unknown = f"/v1/device/adapters/{adapter['id'] + 1}"
    assert client.get(unknown, headers=adapter["phone"]["headers"]).status_code == 404


@pytest.mark.parametrize(
    "body, field",
    [
        ({"model": "nope"}, "model"),
        ({"model": "tiny", "config": {"targets": ["zzz"]}}, "targets"),
        ({"model": "tiny", "config": {"max_context": 1}}, "max_context"),
        ({"model": "tiny", "extra": 1}, "extra"),
    ],
)
def test_bad_inference_requests_name_the_field(client, adapter, body, field):
    r = client.post("/v1/device/inference", json=body, headers=adapter["phone"]["headers"])
    assert r.status_code == 422 and field in r.text


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_inference_program_compiles_once_then_is_served(client, tmp_path, tiny_model_dir):
    """The first request starts the build (503 + Retry-After), then the program, its weights and tokenizer download
    with their sha256; the weights are the model's one .ptd; a second request is answered from the cache."""
    register_model(client, tiny_model_dir)
    phone = enroll_device(client, create_user(client))
    body = {"model": "tiny", "config": {"max_context": 32, "rank": 4, "alpha": 8.0}}
    first = client.post("/v1/device/inference", json=body, headers=phone["headers"])
    assert first.status_code == 503 and int(first.headers["retry-after"]) >= 1
    deadline = time.monotonic() + 900
    while (r := client.post("/v1/device/inference", json=body, headers=phone["headers"])).status_code == 503:
        assert time.monotonic() < deadline, "the inference program did not build in 15 minutes"
        time.sleep(0.2)
    assert r.status_code == 200, r.text
    served = r.json()
    assert "model" not in served["manifest"] and served["manifest"]["config"]["max_context"] == 32
    for part in ("program", "weights", "tokenizer"):
        got = client.get(served[part]["url"], headers=phone["headers"])
        assert got.status_code == 200 and hashlib.sha256(got.content).hexdigest() == served[part]["sha256"]
    assert served["weights"]["sha256"] == served["manifest"]["ptd"]["sha256"]
    started = time.monotonic()
    again = client.post("/v1/device/inference", json=body, headers=phone["headers"])
    assert again.status_code == 200 and again.json() == served and time.monotonic() - started < 5
    assert client.get(served["program"]["url"], headers=create_user(client, "bob")).status_code == 403
    carol = enroll_device(client, create_user(client, "carol"))  # inference programs hold no user's data
    assert client.get(served["program"]["url"], headers=carol["headers"]).status_code == 200
