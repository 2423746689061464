"""benchmarks/population.py at a small scale: simulated member devices against a real server over a real socket
(the app in a thread, its compile queue making small fake programs; uploads verified by the real replay), a
synchronous and a buffered job on the same trace."""

from __future__ import annotations

import os
from argparse import Namespace

from benchmarks import population
from server.app import create_app
from server.settings import Settings
from tests.server.factories import ADMIN_TOKEN, FakeCompileQueue, make_fake_model
from tests.server.live import app_in_thread


def test_a_small_population_cycles_both_modes_without_a_server_error(tmp_path, capsys):
    settings = Settings(
        data_dir=tmp_path / "data", database_url=f"sqlite:///{tmp_path / 'db'}", admin_token=ADMIN_TOKEN
    )
    app = create_app(settings, queue_factory=FakeCompileQueue().bind)
    args = Namespace(
        devices=24,
        duration=5.0,
        modes="sync,buffered",
        k=3,
        day_s=5.0,
        part_s=0.5,
        straggler_factor=8.0,
        dropout=0.1,
        round_timeout_s=3600.0,
        seed=0,
        poll_s=0.5,
    )
    with app_in_thread(app) as url:
        rows = population.simulate(url, make_fake_model(tmp_path / "model"), args, ADMIN_TOKEN, os.getpid())
    population.print_table(rows)
    sync, buffered = rows
    assert (sync["mode"], buffered["mode"]) == ("sync", "buffered")
    for row in rows:
        assert row["server_errors"] == 0, row["error_kinds"]
        assert row["parts_counted"] >= row["versions"] * args.k  # a close counts what waits: K, or a few more
        assert row["parts_leased"] >= row["parts_counted"] + row["parts_wasted"]
        assert row["lease_p95_ms"] > 0 and row["heartbeat_p95_ms"] > 0
    assert buffered["versions"] >= 2 and buffered["versions"] > sync["versions"]
    assert "buffered / sync" in capsys.readouterr().out or sync["versions"] == 0
