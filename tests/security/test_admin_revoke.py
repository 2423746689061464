"""The admin revokes a device from the dashboard, as the REST API lets them (``POST /v1/devices/{id}/revoke``):
the admin page lists every device with a revoke form that carries the session's CSRF token, and the revocation
refuses the device's token and puts its job back in the queue."""

from __future__ import annotations

import re
from pathlib import Path

from fastapi.testclient import TestClient

from tests.server.factories import ADMIN_TOKEN, create_user, enroll_device, leased_job

CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')


def test_the_admin_revokes_any_device_from_the_admin_page(client: TestClient, tmp_path: Path) -> None:
    client.base_url = client.base_url.copy_with(scheme="https")  # the session cookie is Secure
    client.follow_redirects = False
    work = leased_job(client, tmp_path / "model")
    phone = work["phone"]
    bobs_tablet = enroll_device(client, create_user(client, "bob"), "bobs-tablet")
    form = client.get("/ui/login")
    signed_in = client.post("/ui/login", data={"api_key": ADMIN_TOKEN, "csrf_token": CSRF.search(form.text).group(1)})
    assert signed_in.status_code == 303

    page = client.get("/ui/admin")
    assert page.status_code == 200
    devices = page.text[page.text.index('<table id="devices">') :]
    devices = devices[: devices.index("</table>")]
    assert f"#{phone['id']} phone" in devices and f"#{bobs_tablet['id']} bobs-tablet" in devices
    assert f"job #{work['job']['id']}" in devices  # the lease the phone holds
    revoke = f"/ui/devices/{phone['id']}/revoke"
    assert f'action="{revoke}"' in devices and f'action="/ui/devices/{bobs_tablet["id"]}/revoke"' in devices
    csrf = CSRF.search(devices).group(1)

    assert client.post(revoke, data={}).status_code == 403  # without the form's token: refused, nothing revoked
    assert client.post("/v1/leases", headers=phone["headers"]).status_code != 401
    done = client.post(revoke, data={"csrf_token": csrf})
    assert done.status_code == 303 and done.headers["location"] == "/ui/admin"

    refused = client.post("/v1/leases", headers=phone["headers"])
    assert refused.status_code == 401 and "revoked" in refused.json()["detail"]
    assert client.get(f"/v1/jobs/{work['job']['id']}", headers=work["user"]).json()["status"] == "ready"
    after = client.get("/ui/admin").text
    assert f'action="{revoke}"' not in after and "revoked" in after
    assert f'action="/ui/devices/{bobs_tablet["id"]}/revoke"' in after  # only the one revoked
    assert client.post("/ui/devices/999999/revoke", data={"csrf_token": csrf}).status_code == 404
