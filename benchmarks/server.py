"""How fast does the server hand out work? Lease + heartbeat throughput and latency with many concurrent
simulated devices on loopback, and compile time for a new vs a cached program config.

A real ``mobizo server`` process is started per database (SQLite file, and PostgreSQL when --database-url or
MOBIZO_TEST_DATABASE_URL is set; a private schema, dropped afterwards). One job with a new config measures a real
export; a second with the same config measures the cache path. Then ``--jobs`` more jobs (cached) are queued and
``--devices`` asyncio clients each loop: lease → ``--heartbeats`` heartbeats → next lease, until the jobs run out
or ``--duration`` passes. Client and server share this machine's cores, so the figures are a floor.

Noisy neighbour (``--noisy-uploads N``, 0 to skip): a quiet user's device makes N small valid uploads, timed, first
alone, then while ``--noisy-devices`` devices of another user upload well-formed 60,000-step logs whose B the log
does not give (each costs a full replay before it is refused), over and over. The quiet user's p95 upload time
with the noise should stay within 2x of the quiet case.

    python benchmarks/server.py --devices 32 --duration 15 --out runs/bench_server.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
ADMIN = "bench-admin-token"
SPEC = {"model": "tiny", "task": "sst2", "q": 2, "batch_size": 4, "steps": 10, "rank": 4, "alpha": 8.0, "seq_len": 48}


@contextmanager
def running_server(db_url: str, data_dir: Path, log: Path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "DATABASE_URL": db_url,
        "MOBIZO_DATA_DIR": str(data_dir),
        "MOBIZO_ADMIN_TOKEN": ADMIN,
        "MOBIZO_LEASE_S": "600",
        "MOBIZO_MAX_ACTIVE_JOBS": "100000",  # the load phase queues hundreds of jobs for one user
        "MOBIZO_MAX_COMPILES": "100000",
        "MOBIZO_ENROLLMENT_CODES_PER_HOUR": "100000",
    }
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mobizo", "server", "--port", str(port), "--log-level", "warning"],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/healthz").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            raise SystemExit(f"server did not start; see {log}")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@contextmanager
def pg_schema(base_url: str):
    from sqlalchemy import create_engine, text

    schema = f"mobizo_bench_{uuid.uuid4().hex[:10]}"
    engine = create_engine(base_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield f"{base_url}{'&' if '?' in base_url else '?'}options=-csearch_path%3D{schema}"
    finally:
        with engine.connect() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        engine.dispose()


def wait_ready(user: httpx.Client, job_id: int, timeout: float = 1800) -> float:
    """Seconds until the job leaves queued/compiling (it must become ready)."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        job = user.get(f"/v1/jobs/{job_id}").json()
        if job["status"] not in ("queued", "compiling"):
            if job["status"] != "ready":
                raise SystemExit(f"job {job_id}: {job['status']}: {job['error']}")
            return time.perf_counter() - started
        time.sleep(0.05)
    raise SystemExit(f"job {job_id} not compiled after {timeout} s")


def setup(url: str, model_dir: Path, n_devices: int, n_jobs: int) -> dict:
    """User, model, the two timed compiles, the queued jobs and the devices' tokens."""
    admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
    key = admin.post("/v1/users", json={"name": "bench"}).raise_for_status().json()["api_key"]
    admin.post("/v1/models", json={"name": "tiny", "path": str(model_dir)}).raise_for_status()
    user = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    times = {}
    for label in ("new", "cached"):
        job = user.post("/v1/jobs", json=SPEC).raise_for_status().json()
        times[f"compile_{label}_s"] = wait_ready(user, job["id"])
    for _ in range(n_jobs - 2):
        user.post("/v1/jobs", json=SPEC).raise_for_status()
    tokens = []
    for i in range(n_devices):
        code = user.post("/v1/enrollment-codes", json={}).json()["code"]
        tokens.append(httpx.post(f"{url}/v1/devices", json={"code": code, "name": f"d{i}"}).json()["token"])
    deadline = time.perf_counter() + 600
    while user.get("/v1/jobs", params={"limit": 1}).json()["data"][0]["status"] != "ready":
        if time.perf_counter() > deadline:
            raise SystemExit("queued jobs did not become ready")
        time.sleep(0.1)
    return {"tokens": tokens, **times}


async def device(url: str, token: str, heartbeats: int, stop_at: float, lat: dict[str, list[float]]) -> None:
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as http:
        while time.perf_counter() < stop_at:
            t = time.perf_counter()
            r = await http.post("/v1/leases")
            lat["lease"].append(time.perf_counter() - t)
            if r.status_code == 204:
                return  # no work left
            job_id = r.raise_for_status().json()["job_id"]
            for step in range(heartbeats):
                t = time.perf_counter()
                (await http.post(f"/v1/jobs/{job_id}/heartbeat", json={"step": step, "loss": 1.0})).raise_for_status()
                lat["heartbeat"].append(time.perf_counter() - t)


async def load(url: str, tokens: list[str], heartbeats: int, duration: float) -> dict:
    lat: dict[str, list[float]] = {"lease": [], "heartbeat": []}
    started = time.perf_counter()
    await asyncio.gather(*(device(url, t, heartbeats, started + duration, lat) for t in tokens))
    elapsed = time.perf_counter() - started
    total = len(lat["lease"]) + len(lat["heartbeat"])
    summary = {"requests": total, "seconds": round(elapsed, 2), "requests_per_s": round(total / elapsed, 1)}
    for kind, values in lat.items():
        values.sort()
        if values:
            summary[f"{kind}_p50_ms"] = round(1000 * statistics.median(values), 1)
            summary[f"{kind}_p95_ms"] = round(1000 * values[int(0.95 * (len(values) - 1))], 1)
    return summary


NOISY_STEPS = 60_000
WARM_UPLOADS = 4  # more than the server's verify workers (2 by default)


def result_files(spec: dict, d: int, replaying: bool) -> dict:
    """A well-formed result of a lease: the job's seeds, lr, eps, g from the losses. ``replaying``: B is the replay
    of the log (a valid upload); otherwise B is zeros, which the log does not give (refused after a full replay)."""
    import numpy as np
    import torch

    from shared.b_file import b_file_bytes
    from shared.noise import step_seed
    from shared.replay import replay
    from shared.train_log import log_line, log_record

    rng = np.random.default_rng(spec["seed"])
    losses = rng.uniform(1, 2, size=(spec["steps"], 2 * spec["q"])).astype(np.float32)
    g = (losses[:, 0::2] - losses[:, 1::2]) / (np.float32(spec["eps"]) * np.float32(2))
    records = [
        log_record(k, step_seed(spec["seed"], k), spec["lr"], spec["eps"], g[k], losses[k])
        for k in range(spec["steps"])
    ]
    b = replay(torch.zeros(d), records).numpy() if replaying else np.zeros(d, np.float32)
    log = "".join(map(log_line, records)).encode()
    return {"b_flat": ("b.safetensors", b_file_bytes(b)), "log": ("log.jsonl", log), "metrics": ("m.json", b"{}")}


def _enrolled(url: str, user: httpx.Client, name: str) -> httpx.Client:
    code = user.post("/v1/enrollment-codes", json={}).raise_for_status().json()["code"]
    token = httpx.post(f"{url}/v1/devices", json={"code": code, "name": name}).raise_for_status().json()["token"]
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=600)


def _timed_uploads(device: httpx.Client, n: int) -> list[float]:
    """Lease, upload a valid result, n times → the upload times in seconds."""
    times = []
    for _ in range(n):
        lease = device.post("/v1/leases").raise_for_status().json()
        files = result_files(lease["spec"], lease["manifest"]["lora_size"], replaying=True)
        started = time.perf_counter()
        device.post(f"/v1/jobs/{lease['job_id']}/result", files=files).raise_for_status()
        times.append(time.perf_counter() - started)
    return times


def _p95_ms(values: list[float]) -> float:
    values = sorted(values)
    return round(1000 * values[int(0.95 * (len(values) - 1))], 1)


def noisy_neighbour(url: str, uploads: int, noisy_devices: int) -> dict:
    """The quiet user's p95 upload time alone and while another user's devices upload non-replaying 60k-step logs."""
    admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
    users = {}
    for name in ("quiet", "noisy"):
        key = admin.post("/v1/users", json={"name": name}).raise_for_status().json()["api_key"]
        users[name] = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    quiet = _enrolled(url, users["quiet"], "quiet")
    noisy = [_enrolled(url, users["noisy"], f"noisy{i}") for i in range(noisy_devices)]
    quiet_jobs = 2 * uploads + WARM_UPLOADS
    jobs = [users["quiet"].post("/v1/jobs", json=SPEC).raise_for_status().json()["id"] for _ in range(quiet_jobs)]
    for _ in noisy:
        jobs.append(
            users["noisy"].post("/v1/jobs", json={**SPEC, "steps": NOISY_STEPS}).raise_for_status().json()["id"]
        )
    for i, job_id in enumerate(jobs):
        wait_ready(users["quiet"] if i < quiet_jobs else users["noisy"], job_id)
    _timed_uploads(quiet, WARM_UPLOADS)  # every verify worker started (torch imported) before timing
    alone = _timed_uploads(quiet, uploads)

    stop, statuses = threading.Event(), []

    def make_noise(device: httpx.Client) -> None:
        lease = device.post("/v1/leases").raise_for_status().json()
        files = result_files(lease["spec"], lease["manifest"]["lora_size"], replaying=False)
        while not stop.is_set():
            r = device.post(f"/v1/jobs/{lease['job_id']}/result", files=files)
            statuses.append(r.status_code)
            stop.wait(float(r.headers.get("retry-after", 0)))  # as the agent does

    threads = [threading.Thread(target=make_noise, args=(device,)) for device in noisy]
    for thread in threads:
        thread.start()
    time.sleep(5)  # the noisy logs are spooled and replaying
    crowded = _timed_uploads(quiet, uploads)
    stop.set()
    for thread in threads:
        thread.join()
    quiet_p95, noisy_p95 = _p95_ms(alone), _p95_ms(crowded)
    return {
        "quiet_upload_p95_ms": quiet_p95,
        "noisy_upload_p95_ms": noisy_p95,
        "noisy_over_quiet": round(noisy_p95 / quiet_p95, 2),
        "noise_statuses": {str(code): statuses.count(code) for code in sorted(set(statuses))},
    }


def bench_one(db: str, db_url: str, args, model_dir: Path, tmp: Path) -> dict:
    with running_server(db_url, tmp / f"data-{db}", tmp / f"server-{db}.log") as url:
        prepared = setup(url, model_dir, args.devices, args.jobs)
        result = asyncio.run(load(url, prepared.pop("tokens"), args.heartbeats, args.duration))
        if args.noisy_uploads:
            result |= noisy_neighbour(url, args.noisy_uploads, args.noisy_devices)
    return {"db": db, "devices": args.devices, **prepared, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=32)
    parser.add_argument("--jobs", type=int, default=400, help="jobs queued for the load phase (bounds its length)")
    parser.add_argument("--heartbeats", type=int, default=5, help="heartbeats per lease")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds of load at most")
    parser.add_argument(
        "--database-url",
        default=os.environ.get("MOBIZO_TEST_DATABASE_URL"),
        help="PostgreSQL to compare with (a private schema is used and dropped)",
    )
    parser.add_argument("--noisy-uploads", type=int, default=20, help="timed uploads of the quiet user (0: skip)")
    parser.add_argument("--noisy-devices", type=int, default=4, help="devices of the noisy user")
    parser.add_argument("--model", type=Path, help="model directory (default: a fresh tiny model)")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        if args.model is None:
            from shared.tiny_model import make_tiny_model

            args.model = make_tiny_model(tmp / "tiny", seed=0)
        rows = [bench_one("sqlite", f"sqlite:///{tmp / 'bench.db'}", args, args.model, tmp)]
        if args.database_url:
            with pg_schema(args.database_url) as url:
                rows.append(bench_one("postgresql", url, args, args.model, tmp))
    print_table(rows)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=2))


def print_table(rows: list[dict]) -> None:
    cols = [
        "db",
        "devices",
        "compile_new_s",
        "compile_cached_s",
        "requests",
        "requests_per_s",
        "lease_p50_ms",
        "lease_p95_ms",
        "heartbeat_p50_ms",
        "heartbeat_p95_ms",
    ]
    print(" | ".join(cols))
    for row in rows:
        print(
            " | ".join(
                f"{row.get(c):.3f}" if isinstance(row.get(c), float) and c.startswith("compile") else str(row.get(c))
                for c in cols
            )
        )
    base = rows[0]
    print(f"compile: cached config is {base['compile_new_s'] / base['compile_cached_s']:.0f}x faster than a new one")
    for row in rows:
        if "noisy_over_quiet" in row:
            print(
                f"noisy neighbour ({row['db']}): quiet user's upload p95 {row['quiet_upload_p95_ms']} ms alone, "
                f"{row['noisy_upload_p95_ms']} ms beside the noise ({row['noisy_over_quiet']}x; noise answered "
                f"{row['noise_statuses']})"
            )
    if len(rows) > 1:
        print(f"postgresql / sqlite throughput: {rows[1]['requests_per_s'] / base['requests_per_s']:.2f}")


if __name__ == "__main__":
    main()
