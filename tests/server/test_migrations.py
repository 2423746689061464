"""The Alembic migrations build exactly the schema of ``server.tables``, on SQLite and PostgreSQL."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from server.db import make_engine, migrate
from server.tables import Base


def test_migrations_match_the_models_and_rerun_cleanly(empty_db_url):
    engine = make_engine(empty_db_url)
    try:
        migrate(engine)
        migrate(engine)  # the server migrates on every start: the second run must be a no-op
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
            tables = set(inspect(conn).get_table_names())
        assert diff == []
        assert {"users", "models", "devices", "jobs", "programs", "adapters", "enrollment_codes"} <= tables
    finally:
        engine.dispose()


def test_processes_starting_together_migrate_one_after_another(fresh_pg_schema):
    """The startup lock (PostgreSQL advisory lock): the first process gets it at once and is told it is first;
    a second one, starting while the first still migrates, waits, migrates (a no-op by then) and is told not."""
    import threading

    from server.db import startup_lock

    first, second = make_engine(fresh_pg_schema), make_engine(fresh_pg_schema)
    events: list[str] = []
    try:
        with startup_lock(first) as was_first:
            events.append(f"first:{was_first}")
            thread = threading.Thread(target=lambda: _start(second, events))
            thread.start()
            thread.join(timeout=2)
            assert thread.is_alive()  # waiting for the lock
            migrate(first)
            events.append("first migrated")
        thread.join(timeout=30)
        assert events == ["first:True", "first migrated", "second:False", "second migrated"]
        with startup_lock(first) as alone:  # a process starting on its own later
            assert alone
    finally:
        first.dispose()
        second.dispose()


def test_the_startup_lock_is_the_schemas(fresh_pg_schema, pg_url):
    """PostgreSQL's advisory locks belong to the database: a deployment starting in another schema of it (another
    test's, another service's) neither waits for this one's lock nor makes this one wait."""
    from server.db import startup_lock
    from tests.server.conftest import pg_schema

    with pg_schema(pg_url) as other_url:
        here, there = make_engine(fresh_pg_schema), make_engine(other_url)
        try:
            with startup_lock(here) as first_here, startup_lock(there) as first_there:
                assert (first_here, first_there) == (True, True)
        finally:
            here.dispose()
            there.dispose()


def _start(engine, events: list[str]) -> None:
    from server.db import startup_lock

    with startup_lock(engine) as was_first:
        events.append(f"second:{was_first}")
        migrate(engine)
        events.append("second migrated")
