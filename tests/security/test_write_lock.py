"""What must not hold SQLite's write lock: drawing a dashboard page, calibrating a private job's noise, and
verifying an upload.

Every SQLite write transaction of the server takes the write lock up front (``server.db``), so work done inside one
holds up every tenant's writes: a private submit once calibrated its noise (seconds) inside the transaction its
quota check opened, and a page drew its charts inside the transaction that read its rows. Requests now read in
autocommit and write only in the state layer's units of work; each test runs the slow step
through a probe that asks SQLite itself, from a connection of its own with no wait (``timeout=0``), for the write
lock, and for the server process's own turn of it: both must be free while the step runs.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import threading

import pytest
from sqlalchemy import make_url

from server import results
from server.db import begin_write
from shared import accounting
from tests.server.factories import (
    b_flat_bytes,
    create_user,
    leased_job,
    make_fake_model,
    register_model,
    submit_job,
    upload,
)
from tests.server.test_dashboard import browser, key_of, sign_in

LOCK_WAIT_S = 2.0


def _write_lock_free(client) -> bool:
    """Whether a writer could start now: SQLite's lock (another connection) and the server's own turn (a write
    through the app's sessions from another thread, which waits for the turn; it is given 10 s).

    The other connection waits up to ``LOCK_WAIT_S`` for the lock: the server's sweepers take it for a moment every
    half second whether or not there is work, and on a loaded machine the probe can land inside one. A lock the
    request itself holds is never given back while it waits: the probe runs in the request's own thread."""
    path = make_url(str(client.app.state.engine.url)).database
    other = sqlite3.connect(path, timeout=LOCK_WAIT_S, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        other.execute("ROLLBACK")
    except sqlite3.OperationalError:
        return False
    finally:
        other.close()
    done = threading.Event()

    def write() -> None:
        with client.app.state.sessionmaker() as session:
            begin_write(session)  # BEGIN IMMEDIATE, after this process's writer turn
            session.rollback()
        done.set()

    threading.Thread(target=write, daemon=True).start()
    return done.wait(10)


def _probe(monkeypatch, module, name: str, client) -> list[bool]:
    seen: list[bool] = []
    original = getattr(module, name)

    def probed(*args, **kwargs):
        seen.append(_write_lock_free(client))
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, probed)
    return seen


@pytest.fixture
def db_url(tmp_path, sqlite_template) -> str:
    """SQLite only (the write lock is SQLite's): a copy of the migrated template."""
    path = tmp_path / "mobizo.db"
    shutil.copyfile(sqlite_template, path)
    return f"sqlite:///{path}"


def test_a_private_submit_calibrates_and_composes_outside_any_transaction(client, tmp_path, monkeypatch):
    client = client
    register_model(client, make_fake_model(tmp_path / "model"))
    user = create_user(client)
    calibrating = _probe(monkeypatch, accounting, "noise_multiplier", client)
    curves = _probe(monkeypatch, accounting, "run_rdps", client)
    composing = _probe(monkeypatch, accounting, "ledger_epsilon", client)
    fresh = {"epsilon": 3.3, "min_examples": 101}  # calibrated nowhere in this process: the submit calibrates it
    submit_job(client, user, privacy=fresh, q=2, batch_size=4, steps=3)
    assert calibrating == [True] and curves == [True] and composing and all(composing)


def test_a_dashboard_page_draws_its_charts_outside_any_transaction(client, tmp_path, monkeypatch):
    from server.dashboard import charts

    client = browser(client)
    work = leased_job(client, tmp_path / "model", steps=4)
    metrics = json.dumps({"steps": 4, "eval": [{"step": 0, "accuracy": 0.5}, {"step": 4, "accuracy": 0.75}]})
    r = upload(client, work["phone"], work["job"]["id"], b_flat_bytes(work["b"]), work["log"], metrics.encode())
    assert r.status_code == 201, r.text
    sign_in(client, key_of(work["user"]))
    drawing = _probe(monkeypatch, charts, "nice_ticks", client)
    for path in (f"/ui/jobs/{work['job']['id']}", f"/ui/adapters/{r.json()['adapter_id']}"):
        assert client.get(path).status_code == 200
    assert drawing and all(drawing)


def test_an_upload_is_received_and_verified_outside_any_transaction(client, tmp_path, monkeypatch):
    """The result route reads the job, then receives the body and replays the log (seconds, in a worker) before
    its one write, ``state.leases.accept_result``: no lock is held while it waits."""
    work = leased_job(client, tmp_path / "model", steps=4)
    verifying = _probe(monkeypatch, results, "run_verification", client)
    r = upload(client, work["phone"], work["job"]["id"], b_flat_bytes(work["b"]), work["log"])
    assert r.status_code == 201, r.text
    assert verifying == [True]
