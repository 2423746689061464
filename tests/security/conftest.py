"""Fixtures: ``live`` (``mobizo server`` in its own process, compile queue paused) with ``people`` on it (a user, a
device, a queued job), and ``world`` (the app on loopback with the fake compile queue: a job leased to a phone)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.settings import Settings
from tests.security.servers import LiveServer, app_server, live_server
from tests.server.conftest import (  # noqa: F401 - the server tests' database and app fixtures, for these tests too
    client,
    db_url,
    fresh_pg_schema,
    pg_migrated,
    pg_schema,
    pg_url,
    queue,
    settings,
    sqlite_template,
)
from tests.server.factories import (
    ADMIN_TOKEN,
    FakeCompileQueue,
    create_user,
    enroll_device,
    make_fake_model,
    register_model,
    submit_job,
)

# The databases a test of ``live`` runs on, where it opts in: ``@on_both_databases`` (PostgreSQL when
# MOBIZO_TEST_DATABASE_URL names one, else that run is skipped); every other test of ``live`` runs on SQLite.
DATABASES = ("sqlite", "postgresql")
on_both_databases = pytest.mark.parametrize("live", DATABASES, indirect=True, scope="module")


@pytest.fixture(scope="module")
def live(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """``mobizo server`` in its own process on SQLite in its data dir, or (``request.param`` "postgresql", from
    ``on_both_databases``) on a fresh PostgreSQL schema it migrates itself."""
    database = getattr(request, "param", "sqlite")
    with ExitStack() as stack:
        env = {}
        if database == "postgresql":
            env["DATABASE_URL"] = stack.enter_context(pg_schema(request.getfixturevalue("pg_url")))
        yield stack.enter_context(live_server(tmp_path_factory.mktemp(f"live-{database}"), **env))


@pytest.fixture(scope="module")
def people(live: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A registered model, a user with a device and a queued job (the compile queue is paused)."""
    with live.client() as http:
        register_model(http, make_fake_model(tmp_path_factory.mktemp("model")))
        user = create_user(http)
        device = enroll_device(http, user)
        job = submit_job(http, user)
        yield {"client": http, "user": user, "device": device, "job": job}


@pytest.fixture
def world(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The app on loopback (fake compiles, inline replay): ``phone`` holds the lease of ``job``; ``tablet`` and
    ``laptop`` are devices of the same user without one."""
    with leased_world(tmp_path, max_uploads=2, max_uploads_per_device=1) as world:
        yield world


@contextmanager
def leased_world(tmp_path: Path, **overrides: Any) -> Iterator[dict[str, Any]]:
    """``world`` with ``overrides`` of its ``Settings`` (fields of ``server.settings.Settings``)."""
    app_settings = Settings(
        data_dir=tmp_path / "data",
        database_url=f"sqlite:///{tmp_path / 'mobizo.db'}",
        admin_token=ADMIN_TOKEN,
        **overrides,
    )
    with app_server(app_settings, FakeCompileQueue()) as (url, app), httpx.Client(base_url=url, timeout=30) as http:
        register_model(http, make_fake_model(tmp_path / "model"))
        user = create_user(http)
        devices = {name: enroll_device(http, user, name) for name in ("phone", "tablet", "laptop")}
        # rank 256 and 10 steps: parts large enough (D = 6144) for the deeply nested reproductions
        job = submit_job(http, user, device_id=devices["phone"]["id"], rank=256, steps=10)
        lease = http.post("/v1/leases", headers=devices["phone"]["headers"]).json()
        assert lease["job_id"] == job["id"]
        yield {"url": url, "app": app, "client": http, "user": user, "job": job, "lease": lease, **devices}
