"""How fast does the server hand out work? Lease + heartbeat throughput and latency with many concurrent
simulated devices on loopback, and compile time for a new vs a cached program config.

A real ``mobizo server`` process is started per database (SQLite file, and PostgreSQL when --database-url or
MOBIZO_TEST_DATABASE_URL is set; a private schema, dropped afterwards). One job with a new config measures a real
export; a second with the same config measures the cache path. Then ``--jobs`` more jobs (cached) are queued and
``--devices`` asyncio clients each loop: lease → ``--heartbeats`` heartbeats → next lease, until the jobs run out
or ``--duration`` passes. Client and server share this machine's cores, so the figures are a floor.

Scale-out (``--api-workers 1,2,4`` with ``--broker-url``): PostgreSQL is measured with each number of API
processes (``mobizo server --workers N``, ``MOBIZO_QUEUE=celery``, one ``mobizo worker`` compiling), sharing one
data dir so only the first run exports. Each run measures the closed loop above (``--devices`` clients, no think
time: req/s, p50/p95/p99) and an open loop (``--open-devices`` simulated devices, each sending one request per
second at fixed times whatever the answers: p50/p95/p99 measured from the scheduled time, and errors). The open
loop's first ``--open-warmup`` seconds (every device connecting and taking its first lease at once) are reported
apart (``open_warmup_*``); ``open_*`` is the steady state after them, ``open_all_*`` everything.

Noisy neighbour (``--noisy-uploads N``, 0 to skip): a quiet user's device makes N small valid uploads, timed, first
alone, then while ``--noisy-devices`` devices of another user upload well-formed 60,000-step logs whose B the log
does not give (each costs a full replay before it is refused), over and over. The quiet user's p95 upload time
with the noise should stay within 2x of the quiet case.

    python -m benchmarks.server_load --devices 32 --duration 15 --out runs/bench_server.json
    python -m benchmarks.server_load --devices 32 --open-devices 256 --noisy-uploads 0 \
        --database-url postgresql+psycopg://postgres@127.0.0.1:5432/test --broker-url redis://127.0.0.1:6379/0 \
        --api-workers 1,2,4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import httpx

from benchmarks import loadgen

REPO = Path(__file__).resolve().parents[1]
ADMIN = "bench-admin-token"
SPEC = {"model": "tiny", "task": "sst2", "q": 2, "batch_size": 4, "steps": 10, "rank": 4, "alpha": 8.0, "seq_len": 48}


@contextmanager
def running_server(
    db_url: str,
    data_dir: Path,
    log: Path,
    workers: int = 1,
    broker_url: str | None = None,
    compile_workers: int = 1,
    extra_env: dict[str, str] | None = None,
    pids: list[int] | None = None,
    verify_workers: int = 0,
):
    """A ``mobizo server`` process (``workers`` API processes); with ``broker_url``, on the Celery queue with
    a ``mobizo worker`` beside it running ``compile_workers`` exports at once (``--concurrency``), and with
    ``verify_workers``, one running that many replays at once. ``extra_env``: settings of the run's own; ``pids``:
    filled with the processes' ids, the server's first."""
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
    if broker_url:
        env |= {"MOBIZO_QUEUE": "celery", "MOBIZO_BROKER_URL": broker_url}
    env |= extra_env or {}
    command = [sys.executable, "-m", "mobizo", "server", "--port", str(port), "--log-level", "warning"]
    procs = []
    with open(log, "wb") as out:
        procs.append(subprocess.Popen(command + ["--workers", str(workers)], cwd=REPO, env=env, stdout=out, stderr=out))
        if broker_url:
            worker = [sys.executable, "-m", "mobizo", "worker", "--queues", "compile", "--log-level", "warning"]
            worker += ["--concurrency", str(compile_workers)]
            procs.append(subprocess.Popen(worker, cwd=REPO, env=env, stdout=out, stderr=out))
        if broker_url and verify_workers:
            verify = [sys.executable, "-m", "mobizo", "worker", "--queues", "verify", "--log-level", "warning"]
            verify += ["--concurrency", str(verify_workers)]
            procs.append(subprocess.Popen(verify, cwd=REPO, env=env, stdout=out, stderr=out))
    url = f"http://127.0.0.1:{port}"
    if pids is not None:
        pids += [proc.pid for proc in procs]
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
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)


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
    async with loadgen.Client(url, token) as http:
        while time.perf_counter() < stop_at:
            t = time.perf_counter()
            r = await http.post("/v1/leases")
            lat["lease"].append(time.perf_counter() - t)
            if r.status_code == 204:
                return  # no work left
            job_id = r.raise_for_status().json()["job_id"]
            for step in range(heartbeats):
                t = time.perf_counter()
                (await http.post(f"/v1/work/job-{job_id}/heartbeat", {"step": step, "loss": 1.0})).raise_for_status()
                lat["heartbeat"].append(time.perf_counter() - t)


async def load(url: str, tokens: list[str], heartbeats: int, duration: float) -> dict:
    lat: dict[str, list[float]] = {"lease": [], "heartbeat": []}
    started, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(device(url, t, heartbeats, started + duration, lat) for t in tokens))
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    total = len(lat["lease"]) + len(lat["heartbeat"])
    summary = {"requests": total, "seconds": round(elapsed, 2), "requests_per_s": round(total / elapsed, 1)}
    summary["client_cpu_ms"] = round(1000 * cpu / total, 2)  # the load generator's own share of the cores
    for kind, values in lat.items():
        summary |= percentiles(kind, values)
    return summary | percentiles("all", lat["lease"] + lat["heartbeat"])


def percentiles(kind: str, values: list[float]) -> dict[str, float]:
    """p50, p95 and p99 of ``values`` (seconds) in ms, named ``<kind>_p50_ms`` …; nothing for no values."""
    values = sorted(values)
    if not values:
        return {}
    return {f"{kind}_p{q}_ms": round(1000 * values[int(q / 100 * (len(values) - 1))], 1) for q in (50, 95, 99)}


async def open_device(
    url: str,
    token: str,
    heartbeats: int,
    start: float,
    stop_at: float,
    lat: list[tuple[float, float]],
    errors: list[str],
) -> None:
    """One request per second at fixed times (lease, then ``heartbeats`` heartbeats, then the next lease);
    latency counts from the scheduled time, so a slow server shows as latency, not as fewer requests. ``lat``
    gets (scheduled time, latency) pairs."""
    async with loadgen.Client(url, token) as http:
        job_id, beats, due = None, 0, start
        while due < stop_at:
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            try:
                if job_id is None:
                    r = await http.post("/v1/leases")
                    if r.status_code == 200:
                        job_id, beats = r.json()["job_id"], 0
                else:
                    r = await http.post(f"/v1/work/job-{job_id}/heartbeat", {"step": beats, "loss": 1.0})
                    beats += 1
                    if beats >= heartbeats:
                        job_id = None
                if r.status_code >= 300:
                    errors.append(str(r.status_code))
            except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
                errors.append(type(exc).__name__)
            lat.append((due, time.perf_counter() - due))
            due += 1.0


async def open_load(url: str, tokens: list[str], heartbeats: int, duration: float, warmup: float) -> dict:
    lat: list[tuple[float, float]] = []
    errors: list[str] = []
    start = time.perf_counter() + 1.0
    phases = [start + i / len(tokens) for i in range(len(tokens))]  # spread over the first second
    await asyncio.gather(
        *(open_device(url, t, heartbeats, p, start + duration, lat, errors) for t, p in zip(tokens, phases))
    )
    summary = {"open_devices": len(tokens), "open_requests": len(lat), "open_errors": len(errors)}
    summary["open_error_kinds"] = {kind: errors.count(kind) for kind in sorted(set(errors))}
    steady = [latency for due, latency in lat if due >= start + warmup]
    warming = [latency for due, latency in lat if due < start + warmup]
    summary |= percentiles("open_warmup", warming) | percentiles("open_all", [latency for _, latency in lat])
    return summary | percentiles("open", steady)


NOISY_STEPS = 60_000
WARM_UPLOADS = 4  # more than the server's verify workers (2 by default)


def well_formed_log(spec: dict, seed: int) -> list[dict]:
    """The records of a log a device could have written for ``spec`` (a lease's): random losses (from ``seed``),
    their g, the spec's step seeds, lr and eps; the server's checks accept it (its constant lr: the spec's)."""
    import numpy as np

    from shared.noise import step_seed
    from shared.train_log import log_record

    rng = np.random.default_rng(seed)
    losses = rng.uniform(1, 2, size=(spec["steps"], 2 * spec["q"])).astype(np.float32)
    g = (losses[:, 0::2] - losses[:, 1::2]) / (np.float32(spec["eps"]) * np.float32(2))
    return [
        log_record(k, step_seed(spec["seed"], k), spec["lr"], spec["eps"], g[k], losses[k])
        for k in range(spec["steps"])
    ]


def result_files(spec: dict, d: int, replaying: bool) -> dict:
    """A well-formed result of a lease (``well_formed_log``). ``replaying``: B is the replay of the log (a valid
    upload); otherwise B is zeros, which the log does not give (refused after a full replay)."""
    import numpy as np
    import torch

    from shared.b_file import b_file_bytes
    from shared.replay import replay
    from shared.train_log import log_line

    records = well_formed_log(spec, spec["seed"])
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
        device.post(f"/v1/work/job-{lease['job_id']}/result", files=files).raise_for_status()
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
            r = device.post(f"/v1/work/job-{lease['job_id']}/result", files=files)
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


def bench_one(
    db: str, db_url: str, args, model_dir: Path, tmp: Path, workers: int = 1, broker_url: str | None = None
) -> dict:
    label = f"{db}-{workers}" if broker_url else db
    data_dir = tmp / "data"  # one program cache for every run: only the first exports
    cached = (data_dir / "programs").is_dir() and any((data_dir / "programs").iterdir())
    with running_server(db_url, data_dir, tmp / f"server-{label}.log", workers, broker_url) as url:
        n_devices = max(args.devices, args.open_devices)
        jobs = args.jobs + (args.open_devices * int(args.duration + 2) // (args.heartbeats + 1) + 1)
        prepared = setup(url, model_dir, n_devices, jobs)
        if cached:  # the "new" config was compiled by an earlier run
            prepared.pop("compile_new_s")
        tokens = prepared.pop("tokens")
        result = {}
        if args.open_devices:  # first: the closed loop may use up its jobs
            open_tokens = tokens[: args.open_devices]
            result |= asyncio.run(open_load(url, open_tokens, args.heartbeats, args.duration, args.open_warmup))
        result |= asyncio.run(load(url, tokens[: args.devices], args.heartbeats, args.duration))
        if args.noisy_uploads:
            result |= noisy_neighbour(url, args.noisy_uploads, args.noisy_devices)
    return {"db": label, "api_processes": workers, "devices": args.devices, **prepared, **result}


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
    parser.add_argument("--open-devices", type=int, default=0, help="devices of the open loop (0: skip it)")
    parser.add_argument(
        "--open-warmup", type=float, default=2.0, help="first seconds of the open loop, reported apart (connecting)"
    )
    parser.add_argument("--broker-url", help="Celery broker: PostgreSQL is then measured with --api-workers")
    parser.add_argument("--api-workers", default="1,2,4", help="API processes to measure on PostgreSQL (comma list)")
    parser.add_argument("--noisy-uploads", type=int, default=20, help="timed uploads of the quiet user (0: skip)")
    parser.add_argument("--noisy-devices", type=int, default=4, help="devices of the noisy user")
    parser.add_argument("--model", type=Path, help="model directory (default: a fresh tiny model)")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        if args.model is None:
            from shared.tiny_model import make_tiny_model

            args.model = make_tiny_model(tmp / "tiny", seed=0)
        rows = [bench_one("sqlite", f"sqlite:///{tmp / 'bench.db'}", args, args.model, tmp)]
        if args.database_url and args.broker_url:
            for workers in (int(n) for n in args.api_workers.split(",")):
                with pg_schema(args.database_url) as url:
                    rows.append(bench_one("postgresql", url, args, args.model, tmp, workers, args.broker_url))
        elif args.database_url:
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
        "all_p50_ms",
        "all_p95_ms",
        "all_p99_ms",
        "open_devices",
        "open_p50_ms",
        "open_p95_ms",
        "open_p99_ms",
        "open_warmup_p99_ms",
        "open_errors",
        "client_cpu_ms",
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
    for row in rows[1:]:
        print(
            f"{row['db']} / {base['db']} closed-loop throughput: {row['requests_per_s'] / base['requests_per_s']:.2f}"
        )


if __name__ == "__main__":
    main()
