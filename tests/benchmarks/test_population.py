"""benchmarks/population.py at a small scale: 200 simulated member devices against a real server over a real
socket (the app in a thread, its compile queue making small fake programs; uploads verified by the real replay;
idle devices paced by Retry-After), a synchronous and a buffered job on the same trace; and the time-to-target
arithmetic of ``--learn``."""

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
        data_dir=tmp_path / "data",
        database_url=f"sqlite:///{tmp_path / 'db'}",
        admin_token=ADMIN_TOKEN,
        checkin_rate=100.0,  # 200 devices: an idle one is asked to wait 2 s (server.pace)
    )
    app = create_app(settings, queue_factory=FakeCompileQueue().bind)
    args = Namespace(
        devices=200,
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
        assert row["retry_after_s"] == 2  # each of the 200 tenants' one device: 1 * 200 / the check-in rate
        assert "asked too soon" not in row["refused"]  # the simulator honours every wait it was told, as the agent
    assert buffered["versions"] >= 2 and buffered["versions"] > sync["versions"]
    assert "buffered / sync" in capsys.readouterr().out or sync["versions"] == 0


def test_time_to_target_is_the_first_version_at_or_under_it_and_defaults_to_the_synchronous_end():
    sync = {"mode": "sync", "curve": [[0.0, 6.2], [30.0, 6.1], [60.0, 6.0]]}
    buffered = {"mode": "buffered", "curve": [[0.0, 6.2], [8.0, 6.15], [16.0, 5.99], [24.0, 6.05]]}
    assert population.learning([sync, buffered]) == {
        "target_loss": 6.0,
        "sync_s": 60.0,
        "buffered_s": 16.0,
        "sooner": 3.75,
    }
    assert population.learning([sync, buffered], target=5.9) == {"target_loss": 5.9, "sync_s": None, "buffered_s": None}
