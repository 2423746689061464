"""Retry policy against a scripted server (httpx.MockTransport); sleeps and clock are fakes, so no test waits."""

from __future__ import annotations

import random
from collections.abc import Callable

import httpx
import pytest

from shared.retry import Backoff, RetryEvent, RetryPolicy, call_with_retry, is_transient


def scripted(*answers: int | Exception) -> tuple[httpx.Client, list[httpx.Request]]:
    """A client whose n-th request gets the n-th answer (a status code, or an exception raised)."""
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        answer = answers[min(len(seen), len(answers)) - 1]
        if isinstance(answer, Exception):
            raise answer
        headers = {"Retry-After": "7"} if answer == 429 else {}
        return httpx.Response(answer, json={"n": len(seen)}, headers=headers)

    return httpx.Client(transport=httpx.MockTransport(handler), base_url="http://server"), seen


def get_json(client: httpx.Client) -> dict:
    response = client.get("/v1/thing")
    response.raise_for_status()
    return response.json()


def fake_policy(**overrides: object) -> tuple[RetryPolicy, list[float], list[RetryEvent]]:
    sleeps: list[float] = []
    events: list[RetryEvent] = []
    policy = RetryPolicy(sleep=sleeps.append, on_retry=events.append, rng=random.Random(0), clock=lambda: 0.0)
    for name, value in overrides.items():
        setattr(policy, name, value)
    return policy, sleeps, events


def test_transient_failures_are_retried_until_success() -> None:
    client, seen = scripted(503, httpx.ConnectError("refused"), 200)
    policy, sleeps, events = fake_policy()
    assert call_with_retry(policy, get_json, client) == {"n": 3}
    assert len(seen) == 3 and len(sleeps) == 2
    assert [e.attempt for e in events] == [1, 2]
    assert isinstance(events[1].error, httpx.ConnectError)


def test_final_errors_are_not_retried() -> None:
    client, seen = scripted(401, 200)
    policy, sleeps, _ = fake_policy()
    with pytest.raises(httpx.HTTPStatusError) as caught:
        call_with_retry(policy, get_json, client)
    assert caught.value.response.status_code == 401
    assert (len(seen), sleeps) == (1, [])


def test_max_tries_reraises_the_last_error() -> None:
    client, seen = scripted(httpx.ReadTimeout("slow"))
    policy, sleeps, _ = fake_policy(max_tries=3)
    with pytest.raises(httpx.ReadTimeout):
        call_with_retry(policy, get_json, client)
    assert (len(seen), len(sleeps)) == (3, 2)


def test_retry_after_is_honoured() -> None:
    client, _ = scripted(429, 200)
    policy, sleeps, _ = fake_policy(backoff=Backoff(base=0.1, cap=0.1))
    call_with_retry(policy, get_json, client)
    assert sleeps == [7.0]


def test_max_time_gives_up_before_a_wait_that_would_pass_it() -> None:
    now = [0.0]
    client, seen = scripted(503)
    policy, sleeps, _ = fake_policy(max_time=10.0, backoff=Backoff(base=4.0, factor=1.0, cap=4.0))
    policy.clock = lambda: now[0]
    policy.sleep = lambda s: now.__setitem__(0, now[0] + s) or sleeps.append(s)
    policy.rng = FixedRandom()
    with pytest.raises(httpx.HTTPStatusError):
        call_with_retry(policy, get_json, client)
    assert sleeps == [4.0, 4.0]  # a third wait would end at 12 s > 10 s
    assert len(seen) == 3


def test_stop_ends_the_wait_and_reraises() -> None:
    stop: list[bool] = []
    client, seen = scripted(503, 200)
    policy, _, _ = fake_policy(stopped=lambda: bool(stop))
    policy.sleep = lambda s: stop.append(True)
    with pytest.raises(httpx.HTTPStatusError):
        call_with_retry(policy, get_json, client)
    assert len(seen) == 1


class FixedRandom(random.Random):
    """Jitter that always picks the ceiling, to make delays exact."""

    def uniform(self, a: float, b: float) -> float:
        return b


def test_backoff_grows_exponentially_up_to_the_cap() -> None:
    backoff = Backoff(base=0.5, factor=2.0, cap=3.0)
    assert [backoff.delay(n, FixedRandom()) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    rng = random.Random(1)
    assert all(0.0 <= backoff.delay(n, rng) <= min(3.0, 0.5 * 2 ** (n - 1)) for n in range(1, 50))


@pytest.mark.parametrize(
    "make, transient",
    [
        (lambda: httpx.ConnectError("x"), True),
        (lambda: httpx.RemoteProtocolError("x"), True),
        (lambda: status_error(502), True),
        (lambda: status_error(404), False),
        (lambda: ValueError("x"), False),
    ],
)
def test_is_transient(make: Callable[[], Exception], transient: bool) -> None:
    assert is_transient(make()) is transient


def status_error(code: int) -> httpx.HTTPStatusError:
    request = httpx.Request("GET", "http://server/x")
    return httpx.HTTPStatusError("x", request=request, response=httpx.Response(code, request=request))
