"""Pace steering: when a device with nothing to do should ask for work again, and refusing one that asks sooner.

An idle device asks for work on a timer (the agent's 5 s): 10,000 of them would ask 2,000 times a second, for
nothing, and crowd out the requests of the devices that train. So the server's 204 ("no work for you now") carries
``Retry-After``, in whole seconds when it comes to one second or more (at most ``MAX_RETRY_AFTER_S``), from
``MOBIZO_CHECKIN_RATE`` R, the idle asks a second the server wants from its whole population. The rate is shared
fairly among the tenants (users) with devices heard from (or enrolled) in the last hour: each of the T tenants gets
R / T asks a second, which its n devices share, so a device of that tenant waits n · T / R seconds. The
population's idle asks then stay near R whatever its size, and one tenant's devices, however many, move only that
tenant's wait (another's depends on T alone). A small population (whose waits come to under a second) is told
nothing and polls as it likes. The agent waits the longer of its own interval and the server's. (The idea is the
"pace steering" of Bonawitz et al., *Towards Federated Learning at Scale*, 2019.)

A device that was told a wait and asks again before ``EARLY_FRACTION`` of it has passed is refused with 429 and
``Retry-After`` (the rest of its wait), before anything else is done for it. What each device was told is kept by
the API process that told it: with several processes behind a balancer, each holds its own devices to what it said.

The counts are read at most every ``COUNT_EVERY_S`` seconds per process: one grouped ``COUNT`` over the devices, not
one per request.
"""

from __future__ import annotations

import math
import threading
import time
from datetime import timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from server.tables import Device, utcnow

SEEN_WITHIN = timedelta(hours=1)
COUNT_EVERY_S = 10.0
MAX_RETRY_AFTER_S = 900
EARLY_FRACTION = 0.9  # a device asking again before this share of its wait has passed is refused (timers are not exact)


class Pace:
    """One process's view of the population (devices per tenant, refreshed at most every ``COUNT_EVERY_S``) and of
    the waits it told devices."""

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._counted_at = -math.inf
        self._per_user: dict[int, int] = {}
        self._told: dict[int, tuple[float, int]] = {}  # device id -> (when, the wait it was told)
        self._kept = 0  # entries of _told after its last pruning

    def _counts(self, session: Session) -> dict[int, int]:
        """Devices (not revoked) heard from, or enrolled, within ``SEEN_WITHIN``, per user, as last counted."""
        with self._lock:
            if self._clock() - self._counted_at < COUNT_EVERY_S:
                return self._per_user
            self._counted_at = self._clock()
        heard = func.coalesce(Device.last_seen_at, Device.created_at)  # enrolling is being heard from
        seen = (
            select(Device.user_id, func.count())
            .where(Device.revoked_at.is_(None), heard >= utcnow() - SEEN_WITHIN)
            .group_by(Device.user_id)
        )
        self._per_user = {user_id: int(count) for user_id, count in session.execute(seen)}
        return self._per_user

    def devices(self, session: Session) -> int:
        """Devices heard from, or enrolled, within ``SEEN_WITHIN``, of every tenant, as last counted."""
        return sum(self._counts(session).values())

    def retry_after_s(self, session: Session, checkin_rate: float, user_id: int) -> int | None:
        """Seconds an idle device of ``user_id`` should wait before it asks again (its devices n, tenants T: n · T /
        R), or None (under a second). A tenant the last count missed (its first device just enrolled) counts as one
        device more and one tenant more."""
        counts = self._counts(session)
        devices, tenants = counts.get(user_id, 0), len(counts)
        if devices == 0:
            devices, tenants = 1, tenants + 1
        wait = devices * tenants / checkin_rate
        return min(MAX_RETRY_AFTER_S, math.ceil(wait)) if wait >= 1 else None

    def told(self, device_id: int, wait_s: int) -> None:
        """The device was told to wait ``wait_s`` seconds before it asks again."""
        now = self._clock()
        with self._lock:
            self._told[device_id] = (now, wait_s)
            if len(self._told) > 2 * self._kept + 1000:  # drop the waits that are over, now and then
                self._told = {d: (at, s) for d, (at, s) in self._told.items() if now < at + s}
                self._kept = len(self._told)

    def too_soon(self, device_id: int) -> int | None:
        """When the device asks before ``EARLY_FRACTION`` of the wait it was told has passed: the seconds left of
        that wait (at least 1); else None."""
        now = self._clock()
        with self._lock:
            told = self._told.get(device_id)
            if told is None:
                return None
            at, wait_s = told
            if now >= at + EARLY_FRACTION * wait_s:
                if now >= at + wait_s:
                    del self._told[device_id]
                return None
        return max(1, math.ceil(at + wait_s - now))
