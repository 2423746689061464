"""The dashboard's sign-in against guessing and piling up: failed sign-ins are throttled per account from one client
address and per client address (429 with ``Retry-After``, before the key is checked), so that nobody can keep
another user out (guesses at an account from many addresses once locked its owner out everywhere), and a user, or
the admin, holds a bounded number of sessions. The throttle's clock is the test's: a window passes when the test
moves it on, however slowly the machine serves the sign-ins before."""

from __future__ import annotations

import math
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, func, select

from server.app import create_app
from server.settings import Settings
from server.tables import WebSession
from tests.security.servers import live_server
from tests.server.factories import ADMIN_TOKEN, FakeCompileQueue, create_user

CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')
WINDOW_S = 60.0


class Clock:
    """A monotonic clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@contextmanager
def served(settings: Settings, **overrides: object) -> Iterator[FastAPI]:
    """The app with ``overrides`` of ``settings``, started (its lifespan runs until the block ends); its sign-in
    throttle reads ``app.state.clock``."""
    app = create_app(settings.model_copy(update=overrides), queue_factory=FakeCompileQueue().bind)
    with TestClient(app):
        app.state.clock = Clock()
        throttle = app.state.sign_in_throttle
        throttle.addresses.clock = throttle.accounts.clock = app.state.clock
        yield app


def window_passes(app: FastAPI) -> None:
    app.state.clock.now += WINDOW_S


def browser(app: FastAPI, address: str = "203.0.113.7") -> TestClient:
    """A browser at ``address`` (the session cookie is ``Secure``: over HTTPS), redirects not followed."""
    return TestClient(app, base_url="https://testserver", follow_redirects=False, client=(address, 50000))


def sign_in(client: TestClient, key: str):
    form = client.get("/ui/login")
    return client.post("/ui/login", data={"api_key": key, "csrf_token": CSRF.search(form.text).group(1)})


def key_of(headers: dict[str, str]) -> str:
    return headers["Authorization"].split()[1]


def wrong_key(user_id: int) -> str:
    return f"mbzu_{user_id}_{secrets.token_urlsafe(32)}"


def user_id(key: str) -> int:
    return int(key.split("_")[1])


def test_failed_sign_ins_from_one_address_are_throttled_before_the_key_is_checked(settings: Settings) -> None:
    with served(settings, sign_in_window_s=WINDOW_S, sign_in_failures_per_address=10) as app:
        alice = key_of(create_user(browser(app)))
        guesser = browser(app)
        for n in range(10):  # each at another account (the per-account limit is not reached)
            assert sign_in(guesser, wrong_key(1000 + n)).status_code == 401
        refused = sign_in(guesser, wrong_key(2000))
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["retry-after"]) == math.ceil(WINDOW_S)  # the clock has not moved since
        assert "too many failed sign-ins from this address" in refused.text
        right_too_soon = sign_in(guesser, alice)  # refused before the key is looked at: a right guess says nothing
        assert right_too_soon.status_code == 429 and "mobizo_session" not in guesser.cookies
        assert sign_in(browser(app, "198.51.100.20"), alice).status_code == 303  # another address may

        app.state.clock.now += WINDOW_S - 1
        almost = sign_in(guesser, alice)
        assert almost.status_code == 429 and almost.headers["retry-after"] == "1"
        app.state.clock.now += 1
        assert sign_in(guesser, alice).status_code == 303
        assert guesser.get("/ui/jobs").status_code == 200


def test_an_ipv6_client_is_counted_by_its_slash_64(settings: Settings) -> None:
    with served(settings, sign_in_failures_per_address=10) as app:
        for n in range(10):  # one client holds the whole /64: each guess from another address of it
            assert sign_in(browser(app, f"2001:db8:0:1::{n + 1:x}"), wrong_key(1000 + n)).status_code == 401
        assert sign_in(browser(app, "2001:db8:0:1:ffff::1"), wrong_key(2000)).status_code == 429
        assert sign_in(browser(app, "2001:db8:0:2::1"), wrong_key(2001)).status_code == 401  # the next /64


def test_guesses_at_an_account_hold_back_the_guessers_address_never_the_owner(settings: Settings) -> None:
    with served(settings, sign_in_window_s=WINDOW_S, sign_in_failures_per_account=3) as app:
        alice, bob = key_of(create_user(browser(app))), key_of(create_user(browser(app), "bob"))
        for _ in range(3):  # from one address: that address may not try alice's account again
            assert sign_in(browser(app, "192.0.2.1"), wrong_key(user_id(alice))).status_code == 401
        refused = sign_in(browser(app, "192.0.2.1"), alice)
        assert refused.status_code == 429 and "with this key from this address" in refused.text
        assert int(refused.headers["retry-after"]) >= 1
        assert sign_in(browser(app, "192.0.2.1"), bob).status_code == 303  # another account from there may
        for n in range(10):  # three guesses each from ten more addresses: alice herself still signs in
            for _ in range(3):
                assert sign_in(browser(app, f"198.51.100.{n}"), wrong_key(user_id(alice))).status_code == 401
        assert sign_in(browser(app, "203.0.113.9"), alice).status_code == 303

        for n in range(3):  # any key that is not a user's is a guess at the admin token: one account
            assert sign_in(browser(app, "192.0.2.100"), f"guess-{n}-" + "x" * 16).status_code == 401
        admin = sign_in(browser(app, "192.0.2.100"), ADMIN_TOKEN)
        assert admin.status_code == 429 and "at the admin token from this address" in admin.text
        assert sign_in(browser(app, "192.0.2.150"), ADMIN_TOKEN).status_code == 303  # the admin, elsewhere

        window_passes(app)
        assert sign_in(browser(app, "192.0.2.1"), alice).status_code == 303
        assert sign_in(browser(app, "192.0.2.100"), ADMIN_TOKEN).status_code == 303


def sessions(settings: Settings, user_id: int | None) -> int:
    engine = create_engine(settings.db_url)
    owner = WebSession.user_id.is_(None) if user_id is None else WebSession.user_id == user_id
    try:
        with engine.connect() as conn:
            return conn.scalar(select(func.count(WebSession.id)).where(owner))
    finally:
        engine.dispose()


def test_signing_in_past_the_cap_ends_the_oldest_sessions(settings: Settings) -> None:
    keep = 3
    with served(settings, ui_sessions_per_user=keep) as app:
        alice, bob = key_of(create_user(browser(app))), key_of(create_user(browser(app), "bob"))
        bobs = browser(app)
        assert sign_in(bobs, bob).status_code == 303
        browsers = [browser(app) for _ in range(keep + 5)]
        for client in browsers:
            assert sign_in(client, alice).status_code == 303
        assert sessions(settings, user_id(alice)) == keep
        for client in browsers[:5]:
            assert client.get("/ui/jobs").headers["location"] == "/ui/login"
        for client in browsers[5:]:
            assert client.get("/ui/jobs").status_code == 200
        assert sessions(settings, user_id(bob)) == 1 and bobs.get("/ui/jobs").status_code == 200

        admins = [browser(app) for _ in range(keep + 5)]
        for client in admins:
            assert sign_in(client, ADMIN_TOKEN).status_code == 303
        assert sessions(settings, None) == keep
        assert admins[0].get("/ui/admin").headers["location"] == "/ui/login"
        assert admins[-1].get("/ui/admin").status_code == 200


def _sign_in_from(http: httpx.Client, key: str, forwarded: str) -> httpx.Response:
    """A browser's sign-in through a client that says it forwards for ``forwarded`` (the cookie carried by hand:
    it is ``Secure``, and this client speaks plain HTTP to the loopback server)."""
    headers = {"X-Forwarded-For": forwarded}
    form = http.get("/ui/login", headers=headers)
    cookie = form.headers["set-cookie"].split(";")[0]
    data = {"api_key": key, "csrf_token": CSRF.search(form.text).group(1)}
    return http.post("/ui/login", data=data, headers={**headers, "Cookie": cookie})


@pytest.mark.parametrize("trusted", ["", "127.0.0.1"])
def test_x_forwarded_for_names_the_client_only_from_a_trusted_proxy(tmp_path, trusted: str) -> None:
    """``mobizo server``: by default the client is the connection's peer, whatever ``X-Forwarded-For`` says (it
    was trusted from loopback, so a client on the host, or behind a proxy passing the header on, chose the address
    its failures counted against); with ``MOBIZO_TRUSTED_PROXIES`` naming the proxy, the header names the client."""
    env = {"MOBIZO_SIGN_IN_FAILURES_PER_ADDRESS": "3", "MOBIZO_TRUSTED_PROXIES": trusted}
    with live_server(tmp_path, **env) as live, httpx.Client(base_url=live.url, timeout=30) as http:
        for n in range(3):  # three guesses, each at another account, each "from" another address
            assert _sign_in_from(http, wrong_key(1000 + n), f"198.51.100.{n}").status_code == 401
        answer = _sign_in_from(http, ADMIN_TOKEN, "198.51.100.99")
    if trusted:
        assert answer.status_code == 303, answer.text  # four clients behind the proxy, one failure each
    else:
        assert answer.status_code == 429 and "from this address" in answer.text  # one client, the proxy or not
