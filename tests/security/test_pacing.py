"""Pace steering on a real server (``mobizo server`` in its own process): the idle wait is each tenant's fair share
of the check-in rate, so one tenant's 60 devices move only their own wait (they moved another tenant's from 2 to
61 s), and a device that asks again sooner than it was told is refused with 429 and the rest of its wait (every
ask was answered before, however fast it came)."""

from __future__ import annotations

import time

from server.pace import EARLY_FRACTION
from tests.security.servers import live_server
from tests.server.factories import create_user, enroll_device


def test_one_tenants_devices_move_only_their_own_wait_and_early_asks_are_refused(tmp_path):
    with live_server(tmp_path, MOBIZO_CHECKIN_RATE="1") as live, live.client() as http:
        many, one = create_user(http, "many"), create_user(http, "one")
        fleet = [enroll_device(http, many, f"fleet-{i}") for i in range(60)]
        phone = enroll_device(http, one, "phone")

        # two tenants share 1 ask a second: the phone alone asks every 2 s, the fleet's 60 devices every 120 s each
        told = http.post("/v1/leases", headers=phone["headers"])
        assert told.status_code == 204 and told.headers["retry-after"] == "2", told.headers
        told_at = time.monotonic()
        fleet_told = http.post("/v1/leases", headers=fleet[0]["headers"])
        assert fleet_told.status_code == 204 and fleet_told.headers["retry-after"] == "120"

        # asking again at once, again and again: refused every time, before anything is done for the device
        refused = [http.post("/v1/leases", headers=phone["headers"]) for _ in range(20)]
        assert time.monotonic() - told_at < EARLY_FRACTION * 2, "the machine was too slow to ask within the wait"
        assert {r.status_code for r in refused} == {429}
        assert all(1 <= int(r.headers["retry-after"]) <= 2 for r in refused)
        assert "sooner than told" in refused[0].json()["detail"]
        assert http.post("/v1/leases", headers=fleet[1]["headers"]).status_code == 204  # the others were told nothing

        time.sleep(max(0.0, told_at + 2 - time.monotonic()))  # the wait it was told, and it may ask
        again = http.post("/v1/leases", headers=phone["headers"])
        assert again.status_code == 204 and again.headers["retry-after"] == "2"
