"""Engine, sessions and migrations, for SQLite (the embedded default) and PostgreSQL.

Two kinds of work on one session (``make_sessionmaker``). A session *reads* by default, in autocommit: each
statement is its own snapshot, no transaction is held, and on SQLite no write lock is taken (WAL lets readers read
beside the writer), so a request that reads and then waits (on a thread, a body, a worker) holds up no one. It
*writes* only inside a unit of work that a transition of the state layer (``server.state``,
``server.accounts``) opens with ``begin_write`` and ends with its commit: a real transaction, which on SQLite starts
``BEGIN IMMEDIATE`` (a deferred transaction that reads and then writes can fail at once with "database is locked"
when another connection wrote in between; busy_timeout does not help there). A write statement on a reading
connection is refused (``WriteOutsideTransition``), so a write that bypasses the state layer fails loudly in the
tests instead of committing half a change.

Within one process, writers queue on a Python lock (``_WriterTurns``) before ``BEGIN IMMEDIATE``: SQLite's own
busy handler polls with sleeps of up to 100 ms, so under load a waiting writer slept long after the lock was free
(a heartbeat's p95 was 340 ms at 400 requests a second); a Python lock wakes the next writer at once. Other
processes (the CLI beside a server) still meet SQLite's busy_timeout. PostgreSQL needs nothing special: the lease
query's conditional UPDATE is safe under READ COMMITTED.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, Engine, create_engine, event, make_url, text
from sqlalchemy.orm import Session, SessionTransaction, sessionmaker

from shared.files import PRIVATE_FILE

_ALEMBIC_INI = Path(__file__).with_name("alembic.ini")
# The advisory lock of migrations and startup recovery: ("mobi", the schema's hash). PostgreSQL's advisory locks are
# the database's, so the schema is part of the key: deployments in other schemas of one database do not wait on
# each other.
STARTUP_LOCK_KEY = 0x6D6F6269


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    dbapi_conn.isolation_level = None  # we issue BEGIN ourselves (see _sqlite_begin)
    cursor = dbapi_conn.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: no corruption; a power cut may lose the last commits
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_S * 1000}")
    cursor.close()


_READ_ONLY = "mobizo_read_only"
BUSY_TIMEOUT_S = 30


class _WriterTurns:
    """One SQLite write transaction at a time in this process: taken before ``BEGIN IMMEDIATE``, given back at
    commit or rollback. The wait is bounded like busy_timeout, so a thread that nests two write transactions
    fails as it would have without this lock instead of hanging."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def begin(self, conn: Any) -> None:
        if conn.get_execution_options().get(_READ_ONLY):
            return  # the driver is in autocommit mode: each read is its own snapshot
        if not self._lock.acquire(timeout=BUSY_TIMEOUT_S):
            raise TimeoutError(f"no SQLite write turn within {BUSY_TIMEOUT_S} s (database is locked)")
        conn.info["writer_turn"] = True
        try:
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        except BaseException:
            self.end(conn)
            raise

    def end(self, conn: Any) -> None:
        if conn.info.pop("writer_turn", False):
            self._lock.release()


def read_only_engine(engine: Engine) -> Engine:
    """``engine`` for reads only, in autocommit: each statement is its own snapshot. On SQLite its connections never
    take the write lock; on PostgreSQL they spare the BEGIN and ROLLBACK round trips a one-statement read would
    otherwise cost. Sessions read through it (``make_sessionmaker``), so that a request holding what it read
    holds up no writer."""
    options: dict[str, Any] = {_READ_ONLY: True}
    if engine.dialect.name == "postgresql":  # SQLite's driver is in autocommit already (see _sqlite_pragmas)
        options["isolation_level"] = "AUTOCOMMIT"
    return engine.execution_options(**options)


class WriteOutsideTransition(RuntimeError):
    """A write statement on a reading connection: writes belong in a transition of the state layer."""


def _refuse_writes_on_reads(conn: Connection, clause: Any, *_: Any) -> None:
    if getattr(clause, "is_dml", False) and conn.get_execution_options().get(_READ_ONLY):
        raise WriteOutsideTransition(
            f"{type(clause).__name__} outside a unit of work: writes are transitions of the state layer, which "
            "open one with server.db.begin_write"
        )


_WRITING = "mobizo_writing"


def _write_options(engine: Engine) -> dict[str, Any]:
    if engine.dialect.name == "postgresql":
        return {_READ_ONLY: False, "isolation_level": "READ COMMITTED"}
    return {_READ_ONLY: False}  # SQLite: the begin event takes the writer turn and issues BEGIN IMMEDIATE


def writing(session: Session) -> bool:
    """Whether ``session`` is inside a unit of work (``begin_write``)."""
    return bool(session.info.get(_WRITING))


def begin_write(session: Session) -> None:
    """Open ``session``'s unit of work: the read it was in ends, what it loaded is expired (read again inside, as
    the transaction sees it), and a write transaction begins; the caller's commit (or rollback) ends it. Inside a
    unit already, nothing: a step joins its caller's transaction. Called first by every writer of the state layer."""
    if writing(session):
        return
    session.rollback()  # a read in autocommit: nothing to undo
    session.expire_all()
    session.connection(execution_options=_write_options(session.get_bind()))
    session.info[_WRITING] = True


def discard(session: Session) -> None:
    """End whatever ``session`` has open, undoing any write: after a request that failed or returned inside a unit of
    work (``server.router``), or a read whose statement failed (the connection is given back; the next statement
    starts afresh). Only here and in the state layer's transitions is anything rolled back."""
    session.rollback()


def _unit_ended(session: Session, transaction: SessionTransaction) -> None:
    if transaction.parent is None:
        session.info.pop(_WRITING, None)


def read_only(engine: Engine) -> Connection:
    """A connection of ``read_only_engine`` (``with read_only(engine) as conn``)."""
    return read_only_engine(engine).connect()


def _private_sqlite_file(url: str) -> None:
    """Create the SQLite file 0600 before SQLite does (it would follow the umask); its -wal and -shm files take
    the database file's permissions."""
    database = make_url(url).database
    if database and database != ":memory:" and not database.startswith("file:"):
        os.close(os.open(database, os.O_CREAT | os.O_RDWR, PRIVATE_FILE))
        os.chmod(database, PRIVATE_FILE)


def make_engine(url: str) -> Engine:
    """An engine for ``url``; SQLite files get WAL, foreign keys and immediate transactions, and mode 0600.

    The pool allows more connections than the server's 40 request threads plus its own background threads,
    so that a request never waits for a connection that another waiting request holds. It keeps 32 of them open:
    connections over ``pool_size`` are closed when returned, and with 32 busy devices a pool of 10 opened and
    closed a PostgreSQL connection for most requests (a backend process each time).
    """
    pool = {"pool_size": 32, "max_overflow": 28}
    if url.startswith("sqlite"):
        _private_sqlite_file(url)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": BUSY_TIMEOUT_S}, **pool)
        event.listen(engine, "connect", _sqlite_pragmas)
        turns = _WriterTurns()
        event.listen(engine, "begin", turns.begin)
        event.listen(engine, "commit", turns.end)
        event.listen(engine, "rollback", turns.end)
    else:
        engine = create_engine(url, pool_pre_ping=True, **pool)
    event.listen(engine, "before_execute", _refuse_writes_on_reads)
    return engine


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """Sessions that read in autocommit and write in the units of work the state layer opens (``begin_write``)."""
    sessions = sessionmaker(read_only_engine(engine), expire_on_commit=False)
    event.listen(sessions, "after_transaction_end", _unit_ended)
    return sessions


def migrate(engine: Engine) -> None:
    """Bring the schema to the newest Alembic revision (the server runs this on start)."""
    config = Config(str(_ALEMBIC_INI))
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, "head")


@contextmanager
def startup_lock(engine: Engine) -> Iterator[bool]:
    """Hold the database's startup lock for the block → whether this process got it first.

    On PostgreSQL, a session advisory lock (``STARTUP_LOCK_KEY`` and the current schema): of several API processes
    starting at once, on one machine or many, one migrates and recovers while the others wait; they then find the
    schema current and are told ``False`` (recovery done). A process starting alone gets ``True``. The lock goes
    with the session, so a process killed while holding it releases it. SQLite needs no lock (its migrations run in
    one ``BEGIN IMMEDIATE`` transaction, which serializes them) and always gets ``True``.
    """
    if engine.dialect.name != "postgresql":
        yield True
        return
    with engine.connect() as conn:
        key = {"key": STARTUP_LOCK_KEY, "schema": conn.scalar(text("SELECT hashtext(current_schema())"))}
        first = bool(conn.scalar(text("SELECT pg_try_advisory_lock(:key, :schema)"), key))
        if not first:
            conn.execute(text("SELECT pg_advisory_lock(:key, :schema)"), key)
        conn.commit()
        try:
            yield first
        finally:
            conn.execute(text("SELECT pg_advisory_unlock(:key, :schema)"), key)
            conn.commit()
