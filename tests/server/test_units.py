"""Two kinds of work on one session (``server.db``): it reads in autocommit, and writes only inside a unit of work
that ``begin_write`` opens and a commit (or rollback) ends; a write outside one is refused, and an endpoint that
returns with one open is refused too (``server.router``). On SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

import pytest
from fastapi import Depends, FastAPI, Request
from fastapi.testclient import TestClient
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from server.db import WriteOutsideTransition, begin_write, make_engine, make_sessionmaker, writing
from server.router import Router, WriteLeftOpen
from server.tables import User


@pytest.fixture
def sessions(db_url: str):
    engine = make_engine(db_url)
    yield make_sessionmaker(engine)
    engine.dispose()


def _users(sessions) -> list[str]:
    with sessions() as session:
        return list(session.scalars(select(User.name).order_by(User.id)))


def test_a_write_outside_a_unit_of_work_is_refused_and_nothing_is_written(sessions):
    with sessions() as session:
        session.add(User(name="ann", key_hash="h"))
        with pytest.raises(WriteOutsideTransition, match="begin_write"):
            session.flush()
        session.rollback()
        with pytest.raises(WriteOutsideTransition):
            session.execute(update(User).values(name="bob"))
    assert _users(sessions) == []


def test_a_unit_of_work_commits_all_or_nothing_and_a_step_joins_it(sessions):
    with sessions() as session:
        begin_write(session)
        session.add(User(name="ann", key_hash="h"))
        begin_write(session)  # a step inside its caller's unit: the same transaction, nothing lost
        session.add(User(name="bob", key_hash="h"))
        assert writing(session)
        session.commit()
        assert not writing(session)
        begin_write(session)
        session.add(User(name="cat", key_hash="h"))
        session.flush()
        session.rollback()
        assert not writing(session)
    assert _users(sessions) == ["ann", "bob"]


def test_a_unit_reads_rows_as_its_transaction_sees_them_not_as_loaded_before(sessions):
    """What the session loaded while reading is expired when a unit begins: a decision inside it rests on the row
    as it is now, not on a copy another writer has changed since."""
    with sessions() as session:
        begin_write(session)
        session.add(User(name="ann", key_hash="old"))
        session.commit()
        ann = session.scalars(select(User)).one()
        assert ann.key_hash == "old"
        with sessions() as other:
            begin_write(other)
            other.execute(update(User).values(key_hash="new"))
            other.commit()
        begin_write(session)
        assert ann.key_hash == "new"
        session.rollback()


def _session(request: Request) -> Iterator[Session]:
    with request.app.state.sessions() as session:
        yield session


Db = Annotated[Session, Depends(_session)]


def test_an_endpoint_that_leaves_a_write_open_is_refused_and_rolled_back(sessions):
    router = Router()

    @router.post("/forgets")
    def forgets(session: Db) -> dict:
        begin_write(session)
        session.add(User(name="ann", key_hash="h"))
        return {}

    @router.post("/commits")
    def commits(session: Db) -> dict:
        begin_write(session)
        session.add(User(name="bob", key_hash="h"))
        session.commit()
        return {"users": session.scalar(select(func.count(User.id)))}

    app = FastAPI()
    app.state.sessions = sessions
    app.include_router(router)
    with TestClient(app, raise_server_exceptions=True) as client:
        with pytest.raises(WriteLeftOpen, match="forgets"):
            client.post("/forgets")
        assert client.post("/commits").json() == {"users": 1}
    assert _users(sessions) == ["bob"]
