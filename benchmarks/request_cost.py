"""What does one lease or heartbeat cost the API itself? The app in this process (``TestClient``: no socket, no
load generator beside it, a fake compile queue), one device looping lease → 5 heartbeats over queued jobs;
milliseconds per request, on SQLite and (``--database-url``) PostgreSQL. Read against ``benchmarks/server_load.py``:
1000 / (ms per request) is what one core can serve before any network or client cost.

    python -m benchmarks.request_cost --rounds 100 --database-url postgresql+psycopg://postgres@127.0.0.1:5432/test
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from fastapi.testclient import TestClient

from benchmarks.server_load import pg_schema
from server.app import create_app
from server.settings import Settings
from tests.server.factories import (
    ADMIN_TOKEN,
    FakeCompileQueue,
    create_user,
    enroll_device,
    make_fake_model,
    register_model,
    submit_job,
)

HEARTBEATS = 5


def ms_per_request(db_url: str, tmp: Path, rounds: int) -> float:
    settings = Settings(
        data_dir=tmp / "data",
        database_url=db_url,
        admin_token=ADMIN_TOKEN,
        lease_s=600,
        max_active_jobs=100_000,
        max_compiles=100_000,
    )
    with TestClient(create_app(settings, queue_factory=FakeCompileQueue().bind)) as client:
        register_model(client, make_fake_model(tmp / "model"))
        user = create_user(client)
        phone = enroll_device(client, user)
        for _ in range(rounds + 10):
            submit_job(client, user)

        def one() -> None:
            lease = client.post("/v1/leases", headers=phone["headers"]).json()
            for step in range(HEARTBEATS):
                client.post(f"/v1/work/job-{lease['job_id']}/heartbeat", json={"step": step}, headers=phone["headers"])

        for _ in range(10):  # warm-up
            one()
        start = time.perf_counter()
        for _ in range(rounds):
            one()
        return 1000 * (time.perf_counter() - start) / (rounds * (1 + HEARTBEATS))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=100, help="leases, each followed by 5 heartbeats")
    p.add_argument("--database-url", help="PostgreSQL too (a private schema, dropped afterwards)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        rows = {"sqlite": ms_per_request(f"sqlite:///{tmp / 'db.sqlite'}", tmp / "sqlite", args.rounds)}
        if args.database_url:
            with pg_schema(args.database_url) as url:
                rows["postgresql"] = ms_per_request(url, tmp / "pg", args.rounds)
    print("| database | ms per request | requests/s on one core |\n|---|---|---|")
    for db, ms in rows.items():
        print(f"| {db} | {ms:.2f} | {1000 / ms:.0f} |")


if __name__ == "__main__":
    main()
