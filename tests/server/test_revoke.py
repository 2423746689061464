"""Revoking a device: its user or the admin revokes it, every route refuses its token from the next request on
(on every API process: two ``mobizo server`` processes over one database), and the work it held goes back to the
queue."""

from __future__ import annotations

from pathlib import Path

import httpx
from fastapi.testclient import TestClient

from tests.server.factories import (
    ADMIN,
    ADMIN_TOKEN,
    b_flat_bytes,
    bearer,
    create_user,
    enroll_device,
    leased_job,
    upload,
)
from tests.server.live import server_process


def _refused(response) -> None:
    assert response.status_code == 401, response.text
    assert "revoked" in response.json()["detail"]


def test_a_revoked_device_is_refused_everywhere_and_its_job_goes_back_to_the_queue(client: TestClient, tmp_path):
    world = leased_job(client, tmp_path / "model")
    user, phone, job = world["user"], world["phone"], world["job"]
    tablet = enroll_device(client, user, "tablet")

    r = client.post(f"/v1/devices/{phone['id']}/revoke", headers=user)
    assert r.status_code == 200, r.text
    revoked_at = r.json()["revoked_at"]
    assert revoked_at is not None

    shown = client.get(f"/v1/jobs/{job['id']}", headers=user).json()
    assert (shown["status"], shown["attempts"]) == ("ready", 1)  # released at once; the attempt stays counted
    headers = phone["headers"]
    _refused(client.post("/v1/leases", headers=headers))
    _refused(client.post(f"/v1/work/job-{job['id']}/heartbeat", json={"step": 1}, headers=headers))
    _refused(client.get(world["lease"]["program"]["url"], headers=headers))
    _refused(client.post(f"/v1/work/job-{job['id']}/fail", json={"error": "x"}, headers=headers))
    _refused(upload(client, phone, job["id"], b_flat_bytes(world["b"]), world["log"]))
    _refused(client.get("/v1/models", headers=headers))

    again = client.post("/v1/leases", headers=tablet["headers"])  # the user's other device takes the job over
    assert again.status_code == 200 and again.json()["job_id"] == job["id"] and again.json()["attempt"] == 2

    listed = {d["id"]: d["revoked_at"] for d in client.get("/v1/devices", headers=user).json()["data"]}
    assert listed == {phone["id"]: revoked_at, tablet["id"]: None}
    r = client.post(f"/v1/devices/{phone['id']}/revoke", headers=user)  # once revoked, always: nothing changes
    assert r.status_code == 200 and r.json()["revoked_at"] == revoked_at
    assert client.get(f"/v1/jobs/{job['id']}", headers=user).json()["status"] == "running"  # the tablet's lease


def test_only_the_devices_user_or_the_admin_revokes_it(client: TestClient):
    alice, bob = create_user(client, "alice"), create_user(client, "bob")
    phone, bobs = enroll_device(client, alice), enroll_device(client, bob)
    assert client.post(f"/v1/devices/{phone['id']}/revoke", headers=bob).status_code == 404
    assert client.post(f"/v1/devices/{phone['id'] + 100}/revoke", headers=alice).status_code == 404
    assert client.post(f"/v1/devices/{phone['id']}/revoke", headers=phone["headers"]).status_code == 403
    assert client.post(f"/v1/devices/{phone['id']}/revoke").status_code == 401
    assert client.post("/v1/leases", headers=phone["headers"]).status_code == 204  # still live
    r = client.post(f"/v1/devices/{bobs['id']}/revoke", headers=ADMIN)
    assert r.status_code == 200 and r.json()["revoked_at"] is not None
    _refused(client.post("/v1/leases", headers=bobs["headers"]))
    assert client.post("/v1/leases", headers=phone["headers"]).status_code == 204


def test_a_device_revoked_through_one_api_process_is_refused_by_another_at_once(tmp_path: Path):
    """Two ``mobizo server`` processes over one database, each with the device's token in its cache (the lease and
    heartbeat routes answer from it): revoked through the first, the device's very next request to the second is
    refused, on the cached routes and the others."""
    env = {"DATABASE_URL": f"sqlite:///{tmp_path / 'mobizo.db'}", "MOBIZO_ADMIN_TOKEN": ADMIN_TOKEN}
    with (  # a data dir each, as two machines would have (nothing here is stored)
        server_process({**env, "MOBIZO_DATA_DIR": str(tmp_path / "a")}, tmp_path / "a.log") as first,
        server_process({**env, "MOBIZO_DATA_DIR": str(tmp_path / "b")}, tmp_path / "b.log") as second,
    ):
        admin = httpx.Client(base_url=first, headers=bearer(ADMIN_TOKEN), timeout=30)
        key = admin.post("/v1/users", json={"name": "alice"}).json()["api_key"]
        user = httpx.Client(base_url=first, headers=bearer(key), timeout=30)
        code = user.post("/v1/enrollment-codes", json={}).json()["code"]
        enrolled = httpx.post(
            f"{first}/v1/devices", json={"code": code, "name": "phone", "platform": "test", "backend": "executorch"}
        ).json()
        devices = [httpx.Client(base_url=url, headers=bearer(enrolled["token"]), timeout=30) for url in (first, second)]
        for device in devices:  # each process now holds the token in its cache
            assert device.post("/v1/leases").status_code == 204
            assert device.post("/v1/work/job-1/heartbeat", json={"step": 0}).status_code == 404
        assert user.post(f"/v1/devices/{enrolled['device_id']}/revoke").status_code == 200
        for device in reversed(devices):
            _refused(device.post("/v1/leases"))
            _refused(device.post("/v1/work/job-1/heartbeat", json={"step": 0}))
            _refused(device.get("/v1/models"))
