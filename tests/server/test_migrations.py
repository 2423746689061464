"""The Alembic migrations build exactly the schema of ``server.tables``, on SQLite and PostgreSQL."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from server.db import make_engine, migrate
from server.tables import Base


def test_migrations_match_the_models_and_rerun_cleanly(db_url):
    engine = make_engine(db_url)
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
