"""Pace steering: when a device with nothing to do should ask for work again.

An idle device asks for work on a timer (the agent's 5 s): 10,000 of them would ask 2,000 times a second, for
nothing, and crowd out the requests of the devices that train. So the server's 204 ("no work for you now") carries
``Retry-After``: the number of devices heard from (or enrolled) in the last hour divided by
``MOBIZO_CHECKIN_RATE`` (the idle asks a second the server wants from its whole population), in whole seconds,
when that is at least one second, and at most ``MAX_RETRY_AFTER_S``. The population's idle asks then stay near
that rate whatever its size, and a small one (under the rate) is told nothing and polls as it likes. The agent
waits the longer of its own interval and the server's. (The idea is the "pace steering" of Bonawitz et al.,
*Towards Federated Learning at Scale*, 2019.)

The count is read at most every ``COUNT_EVERY_S`` seconds per process: one ``COUNT`` over the devices, not one per
request.
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


class Pace:
    """One process's view of the population's size, refreshed at most every ``COUNT_EVERY_S``."""

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._counted_at = -math.inf
        self._devices = 0

    def devices(self, session: Session) -> int:
        """Devices (not revoked) heard from, or enrolled, within ``SEEN_WITHIN``, as last counted."""
        with self._lock:
            if self._clock() - self._counted_at < COUNT_EVERY_S:
                return self._devices
            self._counted_at = self._clock()
        heard = func.coalesce(Device.last_seen_at, Device.created_at)  # enrolling is being heard from
        seen = (
            select(func.count()).select_from(Device).where(Device.revoked_at.is_(None), heard >= utcnow() - SEEN_WITHIN)
        )
        self._devices = int(session.scalar(seen) or 0)
        return self._devices

    def retry_after_s(self, session: Session, checkin_rate: float) -> int | None:
        """Seconds an idle device should wait before it asks again, or None (the population is under the rate)."""
        wait = self.devices(session) / checkin_rate
        return min(MAX_RETRY_AFTER_S, math.ceil(wait)) if wait >= 1 else None
