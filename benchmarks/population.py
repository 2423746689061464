"""population: federation at population scale — simulated devices against the real server, synchronous rounds
against buffered ones on the same availability trace.

A real ``mobizo server`` process (``benchmarks.server_load.running_server``: SQLite, or PostgreSQL with
``--database-url``) serves a cohort of ``--devices`` members, one simulated device each, driven from this one
process on asyncio over a pool of keep-alive connections (``benchmarks.loadgen``). Each device follows a seeded
trace (``traces``): it is available in one window of every ``--day-s`` cycle (a phone on its charger), trains a
part in ``--part-s`` seconds (a third of the devices, the stragglers, take ``--straggler-factor`` times as long),
heartbeats while it trains, asks for work every ``--poll-s`` seconds (the agent's interval, jittered) while it has
none, drops out mid-part with probability ``--dropout`` (its lease then runs out), and
uploads a well-formed log of the part (the lease's seeds, the job's lr and eps, g from its losses: the server's
checks and replay accept it). The same trace runs a synchronous job and a buffered one (``--modes``), each for
``--duration`` seconds, and the script prints, side by side: versions closed (per minute), parts accepted and
wasted (leased but never counted: dropped, late, stale or refused), the p95 latency of lease, heartbeat and result,
server errors (5xx or a broken connection), the bytes a device moved per accepted part, and the CPU the server
and this process used.

    python -m benchmarks.population --devices 200 --duration 60 --out runs/population

What it does not show yet: a held-out loss target reached sooner (the logs are well formed, not trained on data).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from benchmarks import loadgen
from benchmarks.server_load import ADMIN, percentiles, pg_schema, running_server, well_formed_log
from device_agent.daemon import POLL_S

HYPER = {"q": 2, "batch_size": 4, "steps": 4, "rank": 4, "lr": 0.01, "lr_schedule": "constant", "eps": 0.01}
CONNECTIONS = 64  # keep-alive connections the devices share


@dataclass(frozen=True)
class Trace:
    """One device's behaviour: available from ``start`` for ``length`` seconds of every cycle, a part takes
    ``part_s`` seconds, and a part is dropped at its ``drop_at`` fraction (None: finished)."""

    start: float
    length: float
    part_s: float
    drops: float


def traces(n: int, seed: int, day_s: float, part_s: float, straggler_factor: float, dropout: float) -> list[Trace]:
    """``n`` devices' traces: windows of a third to two thirds of a cycle at random offsets; a third of the devices
    stragglers; each part dropped with probability ``dropout``."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        slow = i % 3 == 0
        speed = part_s * (straggler_factor if slow else 1.0) * rng.uniform(0.8, 1.2)
        out.append(Trace(rng.uniform(0, day_s), rng.uniform(day_s / 3, 2 * day_s / 3), speed, dropout))
    return out


@dataclass
class Stats:
    latency: dict[str, list[float]] = field(default_factory=lambda: {"lease": [], "heartbeat": [], "result": []})
    leased: int = 0
    accepted: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    dropped: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    bytes: int = 0

    def error(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1


def part_log(spec: dict, seed: int) -> bytes:
    """A well-formed log of a part (``spec``: the lease's; ``server_load.well_formed_log``), as uploaded."""
    from shared.train_log import log_line

    return "".join(map(log_line, well_formed_log(spec, seed))).encode()


class Connections:
    """A pool of keep-alive connections the simulated devices borrow one request at a time."""

    def __init__(self, url: str, n: int) -> None:
        self._free: asyncio.Queue[loadgen.Client] = asyncio.Queue()
        for _ in range(n):
            self._free.put_nowait(loadgen.Client(url, ""))

    async def post(self, stats: Stats, kind: str, path: str, token: str, payload=None, files=None):
        """→ the response, or None after a broken connection (counted as an error)."""
        client = await self._free.get()
        started = time.perf_counter()
        try:
            if files is None:
                r = await client.post(path, payload, token=token)
            else:
                r = await client.post_files(path, files, token=token)
        except (OSError, TimeoutError, ConnectionError) as exc:
            stats.error(f"{kind}: {type(exc).__name__}")
            return None
        finally:
            self._free.put_nowait(client)
        stats.latency[kind].append(time.perf_counter() - started)
        stats.bytes += len(r.content) + (len(json.dumps(payload)) if payload else 0)
        stats.bytes += sum(map(len, files.values())) if files else 0
        if r.status_code >= 500:
            stats.error(f"{kind}: {r.status_code}")
        return r


async def simulated_device(
    pool: Connections,
    token: str,
    trace: Trace,
    day_s: float,
    stop_at: float,
    stats: Stats,
    rng: random.Random,
    poll_s: float = POLL_S,
) -> None:
    """Lease in the device's window, train (heartbeating), drop out or upload; repeat until ``stop_at``."""
    while (now := time.monotonic()) < stop_at:
        phase = (now - trace.start) % day_s
        if phase > trace.length:  # off the charger: wait for the window
            await asyncio.sleep(min(day_s - phase, stop_at - now))
            continue
        r = await pool.post(stats, "lease", "/v1/leases", token, {"eligible": True})
        if r is None or r.status_code != 200:
            await asyncio.sleep(poll_s * rng.uniform(0.5, 1.5))  # no part now: ask again later, as the agent does
            continue
        lease = r.json()
        stats.leased += 1
        work, heartbeat_s = f"/v1/work/part-{lease['round']['client_id']}", lease["heartbeat_s"]
        drop_at = trace.part_s * rng.random() if rng.random() < trace.drops else None
        trained = 0.0
        while trained < trace.part_s and (drop_at is None or trained < drop_at):
            pause = min(heartbeat_s, trace.part_s - trained)
            await asyncio.sleep(pause)
            trained += pause
            beat = await pool.post(stats, "heartbeat", f"{work}/heartbeat", token, {"step": 0})
            if beat is None or beat.status_code != 200 or beat.json()["cancelled"]:
                break
        if drop_at is not None:
            stats.dropped += 1
            continue
        files = {"log": part_log(lease["spec"], rng.randrange(2**31)), "metrics": b"{}"}
        up = await pool.post(stats, "result", f"{work}/result", token, files=files)
        if up is not None and up.status_code == 201:
            stats.accepted += 1
        elif up is not None:
            reason = "stale or late" if up.status_code == 409 else str(up.status_code)
            stats.refused[reason] = stats.refused.get(reason, 0) + 1


def enroll(url: str, model_dir: Path, n: int, admin_token: str = ADMIN) -> tuple[httpx.Client, int, list[str]]:
    """The model, a cohort and ``n`` members with one device each → (admin client, cohort id, device tokens)."""
    admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin_token}"}, timeout=120)
    admin.post("/v1/models", json={"name": "tiny", "path": str(model_dir)}).raise_for_status()
    cohort = admin.post("/v1/cohorts", json={"name": "population", "model": "tiny", "task": "sst2"})
    cohort_id = cohort.raise_for_status().json()["id"]

    async def one(pool: loadgen.Client, i: int) -> str:
        key = (await pool.post("/v1/users", {"name": f"member-{i}"}, token=admin_token)).raise_for_status().json()
        code = (await pool.post("/v1/enrollment-codes", {}, token=key["api_key"])).raise_for_status().json()
        (await pool.post(f"/v1/cohorts/{cohort_id}/join", None, token=key["api_key"])).raise_for_status()
        device = await pool.post("/v1/devices", {"code": code["code"], "name": f"phone-{i}"}, token="-")
        return device.raise_for_status().json()["token"]

    async def all_of_them() -> list[str]:
        clients = [loadgen.Client(url, "") for _ in range(min(CONNECTIONS, n))]
        out: list[str] = []
        for start in range(0, n, len(clients)):
            batch = range(start, min(start + len(clients), n))
            out += await asyncio.gather(*(one(clients[i - start], i) for i in batch))
        return out

    return admin, cohort_id, asyncio.run(all_of_them())


def run_mode(url: str, admin: httpx.Client, cohort_id: int, tokens: list[str], mode: str, args) -> dict:
    """One job of ``mode`` on the trace for ``args.duration`` seconds → its row."""
    fed = {"rounds": 10_000, "clients_per_round": args.k, "round_timeout_s": args.round_timeout_s, "mode": mode}
    job = admin.post(f"/v1/cohorts/{cohort_id}/jobs", json={**HYPER, "seed": args.seed, **fed}).raise_for_status()
    job_id = job.json()["id"]
    while admin.get(f"/v1/jobs/{job_id}").json()["status"] in ("queued", "compiling"):
        time.sleep(0.2)
    trace = traces(len(tokens), args.seed, args.day_s, args.part_s, args.straggler_factor, args.dropout)
    stats, server = Stats(), psutil.Process(args.server_pid)
    cpu_server, cpu_here, started = server.cpu_times(), time.process_time(), time.monotonic()

    async def devices() -> None:
        pool = Connections(url, CONNECTIONS)
        stop_at = time.monotonic() + args.duration
        rngs = [random.Random(args.seed * 100_003 + i) for i in range(len(tokens))]
        await asyncio.gather(
            *(
                simulated_device(pool, t, trace[i], args.day_s, stop_at, stats, rngs[i], args.poll_s)
                for i, t in enumerate(tokens)
            )
        )

    asyncio.run(devices())
    elapsed = time.monotonic() - started
    server_cpu = sum(server.cpu_times()[:2]) - sum(cpu_server[:2])
    admin.post(f"/v1/jobs/{job_id}/cancel")
    rounds = admin.get(f"/v1/jobs/{job_id}/rounds").raise_for_status().json()["data"]
    closed = [r for r in rounds if r["status"] == "closed"]
    clients = [c for r in rounds for c in r["clients"]]
    counted = sum(1 for c in clients if c["counted_in_round_id"] is not None)
    in_flight = sum(1 for c in clients if c["status"] == "leased")
    wasted = len(clients) - counted - in_flight  # expired (dropped, late, left behind) or reported and never counted
    row = {
        "mode": mode,
        "devices": len(tokens),
        "seconds": round(elapsed, 1),
        "versions": len(closed),
        "versions_per_min": round(60 * len(closed) / elapsed, 2),
        "parts_leased": len(clients),
        "parts_accepted": stats.accepted,
        "parts_counted": counted,
        "parts_wasted": wasted,
        "parts_in_flight_at_end": in_flight,
        "wasted_fraction": round(wasted / max(len(clients), 1), 3),
        "dropped": stats.dropped,
        "refused": stats.refused,
        "server_errors": stats.errors,
        "error_kinds": stats.error_kinds,
        "bytes_per_accepted_part": round(stats.bytes / max(stats.accepted, 1)),
        "server_cpu_s": round(server_cpu, 1),
        "simulator_cpu_s": round(time.process_time() - cpu_here, 1),
    }
    for kind, values in stats.latency.items():
        row |= percentiles(kind, values)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--devices", type=int, default=200, help="simulated member devices (one user each)")
    parser.add_argument("--duration", type=float, default=60, help="seconds each mode runs")
    parser.add_argument("--modes", default="sync,buffered", help="comma-separated: sync, buffered")
    parser.add_argument("--k", type=int, default=10, help="K: reports that close a round (version)")
    parser.add_argument("--day-s", type=float, default=60, help="the availability cycle, seconds")
    parser.add_argument("--part-s", type=float, default=3, help="seconds a fast device takes for a part")
    parser.add_argument("--straggler-factor", type=float, default=8, help="a straggler's part takes this many times")
    parser.add_argument("--dropout", type=float, default=0.1, help="probability a part is dropped mid-way")
    parser.add_argument("--lease-s", type=int, default=15, help="the server's lease (MOBIZO_LEASE_S)")
    parser.add_argument("--poll-s", type=float, default=POLL_S, help="an idle device asks for work this often (±50%%)")
    parser.add_argument("--round-timeout-s", type=float, default=3600, help="a round's deadline after its first lease")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, help="model directory (default: a fresh tiny model)")
    parser.add_argument("--database-url", help="PostgreSQL base URL (a private schema is made); default SQLite")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()
    rows = run(args)
    print_table(rows)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "population.json").write_text(json.dumps(rows, indent=2))


def run(args) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = args.model
        if model is None:
            from shared.tiny_model import make_tiny_model

            model = make_tiny_model(tmp / "tiny", seed=0)
        if args.database_url:
            with pg_schema(args.database_url) as url:
                return _run_on(url, tmp, model, args)
        return _run_on(f"sqlite:///{tmp / 'mobizo.db'}", tmp, model, args)


def _run_on(db_url: str, tmp: Path, model: Path, args) -> list[dict]:
    env = {"MOBIZO_LEASE_S": str(args.lease_s)}
    with running_server(db_url, tmp / "data", tmp / "server.log", extra_env=env, pids=(pids := [])) as url:
        return simulate(url, model, args, ADMIN, pids[0])


def simulate(url: str, model: Path, args, admin_token: str, server_pid: int) -> list[dict]:
    """Enroll the population on the server at ``url`` and run each of ``args.modes`` on its trace → the rows."""
    args.server_pid = server_pid
    admin, cohort_id, tokens = enroll(url, model, args.devices, admin_token)
    return [run_mode(url, admin, cohort_id, tokens, mode, args) for mode in args.modes.split(",")]


COLUMNS = (
    "mode",
    "devices",
    "versions",
    "versions_per_min",
    "parts_leased",
    "parts_counted",
    "wasted_fraction",
    "server_errors",
    "lease_p95_ms",
    "heartbeat_p95_ms",
    "result_p95_ms",
    "bytes_per_accepted_part",
    "server_cpu_s",
    "simulator_cpu_s",
)


def print_table(rows: list[dict]) -> None:
    print(" | ".join(COLUMNS))
    for row in rows:
        print(" | ".join(str(row.get(c, "")) for c in COLUMNS))
    if len(rows) == 2 and rows[0]["versions"]:
        print(f"buffered / sync: {rows[1]['versions'] / rows[0]['versions']:.2f}x the versions in the same time")


if __name__ == "__main__":
    main()
