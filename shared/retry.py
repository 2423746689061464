"""Retrying calls to the server, for the agent and the user commands alike: backoff as plain data, a give-up
predicate, injectable sleep and clock.

Modelled on Flower's ``retry_invoker``: a ``RetryPolicy`` says how long to wait between tries (exponential with
full jitter, capped), when to stop (tries, total time, or an error that retrying cannot fix), and whom to tell.
Sleep and clock are fields, so tests run instantly and the daemon can make a wait end early on shutdown.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import httpx

T = TypeVar("T")

# Statuses that say "not now" rather than "not ever".
TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class Backoff:
    """Delay before retry n (n = 1, 2, ...): uniform in [0, min(cap, base * factor**(n-1))] ("full jitter")."""

    base: float = 0.5
    factor: float = 2.0
    cap: float = 30.0

    def delay(self, attempt: int, rng: random.Random) -> float:
        ceiling = min(self.cap, self.base * self.factor ** (attempt - 1))
        return rng.uniform(0.0, ceiling)


@dataclass(frozen=True)
class RetryEvent:
    """What a hook sees before each wait: the try that failed, its error, and the wait chosen."""

    attempt: int
    error: BaseException
    delay: float
    elapsed: float


def is_transient(error: BaseException) -> bool:
    """Network failures and 'try later' statuses are worth retrying; anything else is final."""
    if isinstance(error, httpx.HTTPStatusError):
        return error.response.status_code in TRANSIENT_STATUS
    return isinstance(error, httpx.TransportError)


def retry_after(error: BaseException) -> float | None:
    """The server's ``Retry-After`` in seconds, when it sent one (numeric form only)."""
    if isinstance(error, httpx.HTTPStatusError):
        return retry_after_header(error.response)
    return None


def retry_after_header(response: httpx.Response) -> float | None:
    """A response's ``Retry-After`` in seconds (numeric form only), or None."""
    try:
        return max(0.0, float(response.headers.get("retry-after", "")))
    except ValueError:
        return None


@dataclass
class RetryPolicy:
    backoff: Backoff = field(default_factory=Backoff)
    max_tries: int | None = None  # None: no limit on tries
    max_time: float | None = None  # seconds since the first try; None: no limit
    retryable: Callable[[BaseException], bool] = is_transient
    on_retry: Callable[[RetryEvent], None] | None = None
    sleep: Callable[[float], object] = time.sleep
    clock: Callable[[], float] = time.monotonic
    stopped: Callable[[], bool] = lambda: False  # e.g. a stop event's is_set: give up at the next wait
    rng: random.Random = field(default_factory=random.Random)

    def next_delay(self, attempt: int, error: BaseException, elapsed: float) -> float | None:
        """The wait before the next try, or None to give up and re-raise ``error``."""
        if not self.retryable(error) or self.stopped():
            return None
        if self.max_tries is not None and attempt >= self.max_tries:
            return None
        delay = max(self.backoff.delay(attempt, self.rng), retry_after(error) or 0.0)
        if self.max_time is not None and elapsed + delay > self.max_time:
            return None
        return delay


def call_with_retry(policy: RetryPolicy, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
    """``fn(*args, **kwargs)``, tried again after each retryable error until it succeeds or the policy gives up."""
    start = policy.clock()
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - the policy decides which errors are final
            elapsed = policy.clock() - start
            delay = policy.next_delay(attempt, error, elapsed)
            if delay is None:
                raise
            if policy.on_retry is not None:
                policy.on_retry(RetryEvent(attempt, error, delay, elapsed))
            policy.sleep(delay)
            if policy.stopped():
                raise
