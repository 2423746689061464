"""The admin token and the dashboard: an empty or short token stops the server at start, the dashboard's sign-in
refuses an empty key whatever the settings say, and an admin session ends with the token it was opened with."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from sqlalchemy import create_engine, func, select

from server.app import create_app
from server.settings import Settings
from server.tables import WebSession
from tests.server.factories import ADMIN_TOKEN, FakeCompileQueue, create_user
from tests.server.live import REPO, free_port

CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')


def browser(client: TestClient) -> TestClient:
    """Over HTTPS (the session cookie is ``Secure``), redirects not followed."""
    client.base_url = client.base_url.copy_with(scheme="https")
    client.follow_redirects = False
    return client


@contextmanager
def served(settings: Settings) -> Iterator[TestClient]:
    """The app with ``settings`` (a server started with them), seen by a browser."""
    with TestClient(create_app(settings, queue_factory=FakeCompileQueue().bind)) as client:
        yield browser(client)


def admin_sessions(settings: Settings) -> int:
    engine = create_engine(settings.db_url)
    try:
        with engine.connect() as conn:
            return conn.scalar(select(func.count(WebSession.id)).where(WebSession.user_id.is_(None)))
    finally:
        engine.dispose()


def post_sign_in(client: TestClient, key: str):
    form = client.get("/ui/login")
    return client.post("/ui/login", data={"api_key": key, "csrf_token": CSRF.search(form.text).group(1)})


@pytest.mark.parametrize("token", ["", "hunter2-short", " " * 20, ADMIN_TOKEN + " "])
def test_settings_refuse_an_empty_short_or_padded_admin_token(token: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOBIZO_ADMIN_TOKEN", token)
    with pytest.raises(ValidationError, match="MOBIZO_ADMIN_TOKEN") as refused:
        Settings()
    assert token.strip() == "" or token.strip() not in str(refused.value)  # the secret stays out of the log
    monkeypatch.delenv("MOBIZO_ADMIN_TOKEN")
    assert Settings().admin_token is None  # unset: a server without an admin
    assert Settings(admin_token=ADMIN_TOKEN).admin_token == ADMIN_TOKEN


@pytest.mark.parametrize("token", ["", "hunter2-short"])
def test_a_server_with_a_bad_admin_token_stops_with_one_line_naming_it(tmp_path: Path, token: str) -> None:
    """Exit 2 and one line naming the variable: no traceback, and the token itself stays out of it."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "MOBIZO_DATA_DIR": str(tmp_path / "data"),
        "MOBIZO_ADMIN_TOKEN": token,
    }
    command = [sys.executable, "-m", "mobizo", "server", "--port", str(free_port())]
    run = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    lines = (run.stdout + run.stderr).strip().splitlines()
    assert lines == [lines[0]] and lines[0].startswith("mobizo server: error: MOBIZO_ADMIN_TOKEN must be at least 16")
    assert not token or token not in lines[0]


def test_the_sign_in_refuses_an_empty_key_even_where_the_admin_token_is_empty(settings: Settings) -> None:
    """``model_copy`` does not validate: the app runs with an empty admin token, as an old server did."""
    app = create_app(settings.model_copy(update={"admin_token": ""}), queue_factory=FakeCompileQueue().bind)
    with TestClient(app) as client:
        client = browser(client)
        for key in ("", "   "):
            refused = post_sign_in(client, key)
            assert refused.status_code == 401, refused.headers.get("location")
            assert "mobizo_session" not in client.cookies
            assert client.get("/ui/admin").headers["location"] == "/ui/login"
        form = client.get("/ui/login")
        without_form_token = client.post("/ui/login", data={"api_key": "", "csrf_token": ""})
        assert form.status_code == 200 and without_form_token.status_code == 401  # refused before the CSRF check


def test_an_admin_session_ends_when_the_admin_token_is_rotated_or_unset(settings: Settings) -> None:
    with served(settings) as client:
        alice = create_user(client)["Authorization"].split()[1]
        assert post_sign_in(client, alice).status_code == 303
        users_cookie = client.cookies.get("mobizo_session")
        assert post_sign_in(client, ADMIN_TOKEN).status_code == 303
        admins_cookie = client.cookies.get("mobizo_session")
        assert client.get("/ui/admin").status_code == 200
    assert admin_sessions(settings) == 1

    with served(settings.model_copy(update={"admin_token": "a-rotated-admin-token-0123"})) as client:
        client.cookies.set("mobizo_session", admins_cookie)
        refused = client.get("/ui/admin")
        assert refused.status_code == 303 and refused.headers["location"] == "/ui/login"
        assert admin_sessions(settings) == 0  # deleted, not only refused
        client.cookies.set("mobizo_session", users_cookie)
        assert client.get("/ui/jobs").status_code == 200  # a user's session does not hang on the admin token

    with served(settings) as client:
        assert post_sign_in(client, ADMIN_TOKEN).status_code == 303
        admins_cookie = client.cookies.get("mobizo_session")
    with served(settings.model_copy(update={"admin_token": None})) as client:  # a server without an admin
        client.cookies.set("mobizo_session", admins_cookie)
        assert client.get("/ui/admin").headers["location"] == "/ui/login"
        assert client.get("/ui/jobs").headers["location"] == "/ui/login"
    assert admin_sessions(settings) == 0
    with served(settings) as client:  # the token back as it was: the deleted session stays gone
        client.cookies.set("mobizo_session", admins_cookie)
        assert client.get("/ui/admin").headers["location"] == "/ui/login"
