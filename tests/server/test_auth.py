"""Tokens: admin, user API keys and device tokens; enrollment codes; scoping of devices to their user."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select, update

from server.db import begin_write
from server.security import hash_secret, make_token, parse_token, secret_matches
from server.tables import Device, EnrollmentCode, User, utcnow
from tests.server.factories import ADMIN, bearer, create_user, enroll_device


def test_user_key_is_shown_once_and_stored_only_as_hash(client):
    r = client.post("/v1/users", json={"name": "alice"}, headers=ADMIN)
    assert r.status_code == 201
    key = r.json()["api_key"]
    with client.app.state.sessionmaker() as session:
        user = session.scalars(select(User)).one()
    assert key not in user.key_hash and user.key_hash == hash_secret(parse_token(key)[2])
    assert client.get("/v1/devices", headers=bearer(key)).status_code == 200


@pytest.mark.parametrize(
    ("headers", "code"),
    [({}, 401), (bearer("nonsense"), 401), (bearer("mbzu_1_" + "A" * 43), 403)],
    ids=["missing", "garbage", "user-key-not-admin"],
)
def test_creating_users_needs_the_admin_token(client, headers, code):
    r = client.post("/v1/users", json={"name": "mallory"}, headers=headers)
    assert r.status_code == code
    assert r.json()["detail"]


def test_duplicate_and_malformed_user_names(client):
    create_user(client, "alice")
    assert client.post("/v1/users", json={"name": "alice"}, headers=ADMIN).status_code == 409
    r = client.post("/v1/users", json={"name": "no spaces"}, headers=ADMIN)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "name"]


def test_a_key_with_a_wrong_secret_or_id_is_rejected(client):
    key = client.post("/v1/users", json={"name": "alice"}, headers=ADMIN).json()["api_key"]
    kind, user_id, secret = parse_token(key)
    wrong_secret = make_token(kind, user_id, ("B" if secret[0] != "B" else "C") + secret[1:])
    for token in (wrong_secret, make_token(kind, user_id + 1, secret)):
        assert client.get("/v1/devices", headers=bearer(token)).status_code == 401


def test_token_kinds_do_not_mix(client):
    user = create_user(client)
    device = enroll_device(client, user)
    assert client.get("/v1/devices", headers=device["headers"]).status_code == 403
    assert client.post("/v1/leases", headers=user).status_code == 403
    assert client.post("/v1/leases", headers=ADMIN).status_code == 403


def test_enrollment_code_is_one_time(client):
    user = create_user(client)
    code = client.post("/v1/enrollment-codes", json={"ttl_s": 60}, headers=user).json()["code"]
    body = {"code": code.lower().replace("-", ""), "name": "phone", "backend": "torch", "memory_mb": 4096}
    first = client.post("/v1/devices", json=body)
    assert first.status_code == 201, first.text
    assert client.post("/v1/devices", json=body).status_code == 401
    devices = client.get("/v1/devices", headers=user).json()
    assert devices["count"] == 1 and devices["data"][0]["backend"] == "torch"


def test_expired_enrollment_code_is_refused(client):
    user = create_user(client)
    code = client.post("/v1/enrollment-codes", json={}, headers=user).json()["code"]
    with client.app.state.sessionmaker() as session:
        begin_write(session)
        session.execute(update(EnrollmentCode).values(expires_at=utcnow() - timedelta(seconds=1)))
        session.commit()
    r = client.post("/v1/devices", json={"code": code, "name": "phone"})
    assert r.status_code == 401 and "expired" in r.json()["detail"]
    with client.app.state.sessionmaker() as session:
        assert session.scalars(select(Device)).all() == []


def test_devices_are_scoped_to_their_user(client):
    alice, bob = create_user(client, "alice"), create_user(client, "bob")
    enroll_device(client, alice, "alice-phone")
    assert client.get("/v1/devices", headers=bob).json() == {"data": [], "count": 0}
    assert [d["name"] for d in client.get("/v1/devices", headers=alice).json()["data"]] == ["alice-phone"]


def test_device_token_records_last_seen_at_most_every_30_s(client):
    from datetime import timedelta

    device = enroll_device(client, create_user(client))

    def seen():
        with client.app.state.sessionmaker() as session:
            return session.get(Device, device["id"]).last_seen_at

    assert client.post("/v1/leases", headers=device["headers"]).status_code == 204
    first = seen()
    assert first is not None
    assert client.post("/v1/leases", headers=device["headers"]).status_code == 204
    assert seen() == first  # within 30 s: not written again
    with client.app.state.sessionmaker() as session:
        begin_write(session)
        session.get(Device, device["id"]).last_seen_at = first - timedelta(minutes=1)
        session.commit()
    assert client.post("/v1/leases", headers=device["headers"]).status_code == 204
    assert seen() > first


def test_a_known_device_with_a_wrong_secret_is_refused(client):
    """The token check of a device this process has seen (``DeviceTokens``) still compares the secret."""
    device = enroll_device(client, create_user(client))
    assert client.post("/v1/leases", headers=device["headers"]).status_code == 204  # now cached
    token = device["headers"]["Authorization"].split()[1]
    wrong = token[:-1] + ("A" if token[-1] != "A" else "B")
    r = client.post("/v1/leases", headers={"Authorization": f"Bearer {wrong}"})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    unknown = f"mbzd_{device['id'] + 1000}_{token.split('_', 2)[2]}"
    assert client.post("/v1/leases", headers={"Authorization": f"Bearer {unknown}"}).status_code == 401


def test_secret_comparison_helpers():
    assert secret_matches("abc", hash_secret("abc")) and not secret_matches("abd", hash_secret("abc"))
    assert parse_token("mbzu_12_" + "x" * 43) == ("mbzu", 12, "x" * 43)
    assert parse_token("mbzu_0_" + "x" * 43) is None and parse_token("mbzx_1_" + "x" * 43) is None
