"""Alembic environment: metadata from ``server.tables``; the connection from the server, else from settings.

The server passes its own connection in ``config.attributes["connection"]`` (so that migrations run on the same
engine, SQLite pragmas included); the ``alembic`` command line falls back to ``Settings().db_url``.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from server.tables import Base


def _run(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    from server.db import make_engine
    from server.settings import Settings

    engine = make_engine(Settings().db_url)
    with engine.connect() as conn:
        _run(conn)
    engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (--sql) migrations are not supported; run them against a database")
run_migrations_online()
