"""Heartbeats: a thread that keeps a job's lease alive, reports progress, and learns of cancellation.

The training loop only records its progress (an attribute write per step); the thread sends it every
``interval`` seconds, so the network never slows a step. A failed heartbeat is simply tried again at the next
tick: while the server is down the job trains on, and the lease survives as long as the downtime is shorter than
the lease. The answer can say "cancelled" (stop promptly: training stops after the current step), and 401, 403,
404 or 409 mean the lease is lost (expired, or the job or the device is gone); either way ``halted`` is set and
training stops.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import httpx

from device_agent.api import DeviceAPI
from shared.schemas import HeartbeatCreate

T = TypeVar("T")

LOST_STATUS = frozenset({401, 403, 404, 409})  # the token, the job or the lease is gone


class Heartbeat:
    def __init__(
        self,
        api: DeviceAPI,
        job_id: int,
        interval: float,
        warn: Callable[..., None],
        step: int = 0,
        path: str | None = None,
    ) -> None:
        """``warn(event, **fields)`` reports what happened; ``step``: steps done before this session; ``path``: where
        the heartbeats go when not to the job (a lease's ``work_path``)."""
        self.api, self.job_id, self.interval, self.warn = api, job_id, interval, warn
        self.work: int | str = path or job_id
        self.paused = False  # set while the device's policy keeps training paused: heartbeats say so
        self.cancelled = threading.Event()
        self.lost = threading.Event()
        self._done = threading.Event()
        self._sending = threading.Lock()  # a beat and the call that ends the lease are never in flight together
        self._latest: tuple[int, float | None, float | None] = (step, None, None)
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-{job_id}", daemon=True)
        self._failing = False
        self._first: tuple[int, float] | None = None  # (step, time) of the first progress: steps/s count from it

    @property
    def halted(self) -> bool:
        return self.cancelled.is_set() or self.lost.is_set()

    def progress(self, steps_done: int, loss: float) -> float | None:
        """Record progress (cheap: sent at the next tick); returns the steps/s of this session."""
        now = time.monotonic()
        if self._first is None:
            self._first = (steps_done, now)
        first_step, first_time = self._first
        rate = (steps_done - first_step) / (now - first_time) if now > first_time else None
        self._latest = (steps_done, loss if math.isfinite(loss) else None, rate)
        return rate

    def beat(self) -> None:
        """Send one heartbeat now and act on the answer; none once the lease has ended (``last_call``)."""
        with self._sending:
            if not self._done.is_set():
                self._beat()

    def last_call(self, call: Callable[..., T], *args: object) -> T:
        """Make the call that ends the lease (the upload) with no beat in flight beside it, and send no beat after it
        succeeds: the server answers a beat on an ended lease 409, which is not a lost lease."""
        with self._sending:
            answer = call(*args)
            self._done.set()
            return answer

    def _beat(self) -> None:
        step, loss, rate = self._latest
        try:
            answer = self.api.heartbeat(
                self.work, HeartbeatCreate(step=step, loss=loss, steps_per_s=rate, paused=self.paused)
            )
        except httpx.HTTPError as error:
            status = error.response.status_code if isinstance(error, httpx.HTTPStatusError) else None
            if status in LOST_STATUS:
                self.warn("lease_lost", job_id=self.job_id, reason=str(error))
                self.lost.set()
            elif not self._failing:
                self.warn("heartbeat_failed", job_id=self.job_id, reason=str(error) or type(error).__name__)
            self._failing = True
            return
        if self._failing:
            self.warn("heartbeat_ok", job_id=self.job_id)
        self._failing = False
        if answer.cancelled:
            self.warn("cancelled", job_id=self.job_id)
            self.cancelled.set()

    def _loop(self) -> None:
        while not self._done.wait(self.interval) and not self.halted:
            self.beat()

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
