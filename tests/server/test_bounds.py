"""The largest integers the API accepts fit the database's columns (PostgreSQL INTEGER): stored and looked up
without error on both databases, while one more answers 422 (issue 9, defect 5)."""

from __future__ import annotations

from shared.schemas import MAX_DB_INT
from tests.server.factories import create_user, enroll_device, make_fake_model, register_model, submit_job


def test_largest_accepted_integers_are_stored_and_looked_up(client, tmp_path):
    register_model(client, make_fake_model(tmp_path / "model"))
    user = create_user(client)
    code = client.post("/v1/enrollment-codes", json={}, headers=user).json()["code"]
    enrolled = client.post("/v1/devices", json={"code": code, "name": "big", "memory_mb": MAX_DB_INT})
    assert enrolled.status_code == 201
    phone = enroll_device(client, user)
    job = submit_job(client, user, device_id=phone["id"])
    assert client.post("/v1/leases", json={"memory_mb": MAX_DB_INT}, headers=phone["headers"]).status_code == 200
    heartbeat = f"/v1/work/job-{job['id']}/heartbeat"
    assert client.post(heartbeat, json={"step": 1}, headers=phone["headers"]).status_code == 200
    assert client.get(f"/v1/jobs/{MAX_DB_INT}", headers=user).status_code == 404
    assert client.get("/v1/jobs", params={"skip": MAX_DB_INT}, headers=user).json()["data"] == []
    for path, body in ((heartbeat, {"step": MAX_DB_INT + 1}), ("/v1/leases", {"memory_mb": MAX_DB_INT + 1})):
        assert client.post(path, json=body, headers=phone["headers"]).status_code == 422
    assert client.get(f"/v1/jobs/{MAX_DB_INT + 1}", headers=user).status_code == 422
