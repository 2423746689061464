"""The admin token and the dashboard: an empty or short token stops the server at start, the dashboard's sign-in
refuses an empty key whatever the settings say, and an admin session ends with the token it was opened with."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from server.app import create_app
from server.settings import Settings
from tests.server.factories import ADMIN_TOKEN, FakeCompileQueue
from tests.server.live import server_process

CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')


def browser(client: TestClient) -> TestClient:
    """Over HTTPS (the session cookie is ``Secure``), redirects not followed."""
    client.base_url = client.base_url.copy_with(scheme="https")
    client.follow_redirects = False
    return client


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


def test_a_server_with_an_empty_admin_token_does_not_start(tmp_path: Path) -> None:
    env = {"MOBIZO_DATA_DIR": str(tmp_path / "data"), "MOBIZO_ADMIN_TOKEN": ""}
    with pytest.raises(RuntimeError, match="MOBIZO_ADMIN_TOKEN must be at least 16 characters"):
        with server_process(env, tmp_path / "server.log"):
            pass


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
