"""Compile throughput of the Celery queue: ``--configs`` different program configs submitted at once, compiled by a
``mobizo worker`` running 1 export at a time, then by one running 2 (``--concurrency``), each on a fresh data dir
(nothing cached) and a fresh database. Prints the seconds until every job is ready and the ratio.

    python -m benchmarks.compile_throughput --broker-url redis://127.0.0.1:6379/7 --configs 4 --workers 1,2

Exports are CPU-bound (and single-threaded in parts): on a 2-core machine two at once can at best halve the time.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.server_load import ADMIN, SPEC, running_server


def _configs(n: int) -> list[dict]:
    """``n`` specs whose programs differ (rank 2, 4, 6…): each needs an export of its own."""
    return [{**SPEC, "rank": 2 * (i + 1), "alpha": 4.0 * (i + 1)} for i in range(n)]


def compile_all(url: str, model_dir: Path, configs: list[dict], timeout: float = 3600) -> float:
    """Submit every config at once → seconds until all are ready."""
    admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
    key = admin.post("/v1/users", json={"name": "bench"}).raise_for_status().json()["api_key"]
    admin.post("/v1/models", json={"name": "tiny", "path": str(model_dir)}).raise_for_status()
    user = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    started = time.perf_counter()
    ids = [user.post("/v1/jobs", json=spec).raise_for_status().json()["id"] for spec in configs]
    waiting = set(ids)
    while waiting and time.perf_counter() - started < timeout:
        for job_id in list(waiting):
            job = user.get(f"/v1/jobs/{job_id}").json()
            if job["status"] not in ("queued", "compiling"):
                if job["status"] != "ready":
                    raise SystemExit(f"job {job_id}: {job['status']}: {job['error']}")
                waiting.discard(job_id)
        time.sleep(0.2)
    if waiting:
        raise SystemExit(f"jobs {sorted(waiting)} not compiled after {timeout} s")
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--broker-url", required=True, help="Redis for the Celery queue, e.g. redis://127.0.0.1:6379/7")
    p.add_argument("--configs", type=int, default=4)
    p.add_argument("--workers", default="1,2", help="exports at once to compare (comma list)")
    p.add_argument("--model", type=Path, help="model directory (default: a fresh tiny model)")
    args = p.parse_args()
    from shared.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        model_dir = args.model or make_tiny_model(tmp / "tiny", seed=0)
        results = {}
        for workers in (int(w) for w in args.workers.split(",")):
            run = tmp / f"run-{workers}"
            run.mkdir()
            db = f"sqlite:///{run / 'mobizo.db'}"
            with running_server(db, run / "data", run / "server.log", 1, args.broker_url, workers) as url:
                results[workers] = compile_all(url, model_dir, _configs(args.configs))
            print(f"{args.configs} configs, {workers} export(s) at once: {results[workers]:.1f} s", flush=True)
    base = results[min(results)]
    print("| exports at once | seconds for all | throughput vs 1 |\n|---|---|---|")
    for workers, seconds in results.items():
        print(f"| {workers} | {seconds:.1f} | {base / seconds:.2f}x |")


if __name__ == "__main__":
    main()
