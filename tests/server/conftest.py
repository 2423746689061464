"""Server test fixtures: an empty, migrated database per test (SQLite always, PostgreSQL when
MOBIZO_TEST_DATABASE_URL is set), an app client, and tokens for admin, users and devices.

Migrations run once per session: each SQLite test gets a copy of a migrated template file, and the PostgreSQL tests
share one migrated schema whose tables are truncated before each test (``empty_db_url`` gives an unmigrated
database, for the tests of the migrations themselves)."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.settings import Settings
from tests.server.factories import ADMIN_TOKEN, FakeCompileQueue, InlinePool

PG_ENV = "MOBIZO_TEST_DATABASE_URL"


@pytest.fixture(scope="session")
def pg_url() -> str | None:
    return os.environ.get(PG_ENV)


def _schema_url(base: str, schema: str) -> str:
    separator = "&" if "?" in base else "?"
    return f"{base}{separator}options={quote(f'-csearch_path={schema}')}"


@contextmanager
def pg_schema(pg_url: str | None) -> Iterator[str]:
    """A new, empty PostgreSQL schema; yields a URL whose connections use it; dropped with everything in it."""
    if pg_url is None:
        pytest.skip(f"PostgreSQL not configured ({PG_ENV} unset)")
    from sqlalchemy import create_engine, text

    schema = f"mobizo_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(pg_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield _schema_url(pg_url, schema)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture
def fresh_pg_schema(pg_url: str | None) -> Iterator[str]:
    with pg_schema(pg_url) as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A database with no schema at all: a new SQLite file, or a new PostgreSQL schema."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'mobizo.db'}"
    return request.getfixturevalue("fresh_pg_schema")


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file migrated to the newest revision, once per session."""
    path = tmp_path_factory.mktemp("template") / "mobizo.db"
    _migrate(f"sqlite:///{path}")
    return path


@pytest.fixture(scope="session")
def pg_migrated(pg_url: str | None) -> Iterator[str]:
    """One PostgreSQL schema for the session, migrated once (dropped at the end)."""
    with pg_schema(pg_url) as url:
        _migrate(url)
        yield url


def _migrate(url: str) -> None:
    from server.db import make_engine, migrate

    engine = make_engine(url)
    try:
        migrate(engine)
    finally:
        engine.dispose()  # SQLite: the last connection folds its WAL into the file


def _truncate(url: str) -> None:
    """Empty every table of the schema (not Alembic's version), numbering rows from 1 again. A connection left in
    a transaction by an earlier test would block this: the lock timeout turns that into an error."""
    from sqlalchemy import create_engine, text

    from server.tables import Base

    tables = ", ".join(f'"{table.name}"' for table in Base.metadata.sorted_tables)
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(text("SET LOCAL lock_timeout = '20s'"))
            conn.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    finally:
        engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A migrated database with no rows, on SQLite and on PostgreSQL."""
    if request.param == "sqlite":
        path = tmp_path / "mobizo.db"
        shutil.copyfile(request.getfixturevalue("sqlite_template"), path)
        return f"sqlite:///{path}"
    url = request.getfixturevalue("pg_migrated")
    _truncate(url)
    return url


@pytest.fixture
def settings(tmp_path: Path, db_url: str) -> Settings:
    return Settings(data_dir=tmp_path / "data", database_url=db_url, admin_token=ADMIN_TOKEN, lease_s=60)


@pytest.fixture
def queue() -> FakeCompileQueue:
    return FakeCompileQueue()


@pytest.fixture
def client(settings: Settings, queue: FakeCompileQueue) -> Iterator[TestClient]:
    """The app with a compile queue that 'compiles' instantly into small fake files (no torch)."""
    app = create_app(settings, queue_factory=queue.bind)
    with TestClient(app) as test_client:
        app.state.verify_pool.close()
        app.state.verify_pool = InlinePool()
        app.state.accountant.pool = InlinePool()  # the privacy arithmetic in the test's process (its memo shared)
        yield test_client
