"""population: federation at population scale — simulated devices against the real server, synchronous rounds
against buffered ones on the same availability trace.

A real ``mobizo server`` process (``benchmarks.server_load.running_server``: SQLite, or PostgreSQL with
``--database-url``) serves a cohort of ``--devices`` members, one simulated device each, driven from this one
process on asyncio over a pool of keep-alive connections (``benchmarks.loadgen``). Each device follows a seeded
trace (``traces``): it is available in one window of every ``--day-s`` cycle (a phone on its charger), trains a
part in ``--part-s`` seconds (a third of the devices, the stragglers, take ``--straggler-factor`` times as long),
heartbeats while it trains, asks for work every ``--poll-s`` seconds (the agent's interval, jittered) while it has
none, or after the server's ``Retry-After`` when that is longer (``server.pace``), drops out mid-part with
probability ``--dropout`` (its lease then runs out), and uploads the log of its part: a well-formed one (the lease's
seeds, the job's lr and eps, g from random losses: the server's checks and replay accept it), or with ``--learn``
real steps of the tiny model from the B it leased on its own label-skewed SST-2 shard. The same trace runs a
synchronous job and a buffered one (``--modes``), each for ``--duration`` seconds, and the script prints, side by
side: versions closed (per minute), parts accepted and wasted (leased but never counted: dropped, late, stale or
refused), the p95 latency of lease, heartbeat and result, server errors (5xx or a broken connection), the bytes a
device moved per accepted part, the mean Retry-After the idle devices were given, and the CPU the server and this
process used; with ``--learn``, the held-out loss of every version and the time each job took to reach a target
(by default the loss of the synchronous job's last version), and a picture of both curves.

    python -m benchmarks.population --devices 200 --duration 60 --out runs/population
    python -m benchmarks.population --devices 300 --duration 240 --learn --out runs/population-learn
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import tempfile
import time
from argparse import Namespace
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx
import numpy as np
import psutil
from safetensors.numpy import load

from benchmarks import loadgen
from benchmarks.federation import _eval_batches, _held_out_loss, _local_log, _setup, _shards
from benchmarks.server_load import ADMIN, percentiles, pg_schema, running_server, well_formed_log
from device_agent.daemon import POLL_S, idle_wait
from shared.files import atomic_write, atomic_write_bytes
from shared.tasks import task_data_dir

HYPER = {"q": 2, "batch_size": 4, "steps": 4, "rank": 4, "lr": 0.01, "lr_schedule": "constant", "eps": 0.01}
# --learn: real parts, the federation benchmark's settings (benchmarks/federation.md), on shards of SST-2
LEARN = {"q": 4, "batch_size": 16, "seq_len": 64, "steps": 5, "rank": 8, "lr": 0.05, "eps": 0.01}
LEARN_JOB = {k: LEARN[k] for k in ("q", "batch_size", "steps", "rank", "lr", "eps")} | {"lr_schedule": "constant"}
SHARDS, SHARD_ROWS, SKEW, EVAL_ROWS = (
    8,
    200,
    0.9,
    64,
)  # each shard: 200 rows, 90 % one label; held out: 64 validation rows
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
    latency: dict[str, list[float]] = field(
        default_factory=lambda: {"lease": [], "heartbeat": [], "result": [], "init": []}
    )
    retry_after: list[float] = field(default_factory=list)  # the server's Retry-After on each 204 (0: none)
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


class Learner:
    """Real parts (``--learn``): a device's part is ``spec.steps`` real MobiZO steps of the tiny model, from the B
    it leased, on its own label-skewed shard of SST-2 (``benchmarks.federation``'s clients), run one at a time in
    one thread beside the event loop; and the held-out loss of any B."""

    def __init__(self, model: Path, data_dir: Path, shards: int, folder: Path) -> None:
        hyper = Namespace(model=model, **{k: LEARN[k] for k in ("q", "batch_size", "seq_len", "rank", "lr", "eps")})
        self.setup = _setup(hyper)
        self.shards = _shards(data_dir, shards, SHARD_ROWS, SKEW, folder)
        self.evals = _eval_batches(self.setup, data_dir, EVAL_ROWS)
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="learner")

    async def log(self, device: int, b: np.ndarray, spec: dict) -> bytes:
        """The part's log, as uploaded: the device's steps on its shard from ``b``."""
        from shared.train_log import log_line

        shard = self.shards[device % len(self.shards)]
        run = functools.partial(_local_log, self.setup, b, shard, spec["seed"], spec["steps"])
        records = await asyncio.get_running_loop().run_in_executor(self.thread, run)
        return "".join(map(log_line, records)).encode()

    def loss(self, b: np.ndarray) -> float:
        return _held_out_loss(self.setup, b, self.evals)


class Connections:
    """A pool of keep-alive connections the simulated devices borrow one request at a time."""

    def __init__(self, url: str, n: int) -> None:
        self._free: asyncio.Queue[loadgen.Client] = asyncio.Queue()
        for _ in range(n):
            self._free.put_nowait(loadgen.Client(url, ""))

    async def get(self, stats: Stats, kind: str, path: str, token: str):
        """A GET of ``path`` → the response, or None after a broken connection (counted as an error)."""
        return await self.post(stats, kind, path, token, method="GET")

    async def post(self, stats: Stats, kind: str, path: str, token: str, payload=None, files=None, method="POST"):
        """→ the response, or None after a broken connection (counted as an error)."""
        client = await self._free.get()
        started = time.perf_counter()
        try:
            if method == "GET":
                r = await client.get(path, token=token)
            elif files is None:
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
    learner: Learner | None = None,
    index: int = 0,
    spread_s: float = 0.0,
    told: list[float] | None = None,
) -> None:
    """Lease in the device's window, train (heartbeating), drop out or upload; repeat until ``stop_at``. With no
    part to take, ask again after ``poll_s`` ± 50 %, or after the server's Retry-After (+ up to 50 %) when longer,
    and no sooner when its window opens meanwhile (as the agent, whose wait spans its ineligible time). The first ask
    comes at a random time within ``spread_s`` (the server's pace) or ``poll_s``. ``learner``: the part's log is
    real steps (device ``index``'s shard), else well formed."""
    not_before = time.monotonic() + max(poll_s, spread_s) * rng.random()  # a running fleet's asks are spread
    if told is not None:  # what the server told this device before (the last mode's run, the probe): no sooner
        not_before = max(not_before, told[index])
    while (now := time.monotonic()) < stop_at:
        phase = (now - trace.start) % day_s
        if phase > trace.length:  # off the charger: wait for the window
            await asyncio.sleep(min(day_s - phase, stop_at - now))
            continue
        if now < not_before:  # the server asked for a wait (or the first ask's turn): no sooner, in or out of window
            await asyncio.sleep(min(not_before, stop_at) - now)
            continue
        r = await pool.post(stats, "lease", "/v1/leases", token, {"eligible": True})
        if r is None or r.status_code != 200:
            asked = float(r.headers.get("retry-after", 0)) if r is not None else 0.0
            if r is not None and r.status_code == 204:
                stats.retry_after.append(asked)
            elif r is not None and r.status_code == 429:  # asked sooner than told: the simulator's fault, counted
                stats.refused["asked too soon"] = stats.refused.get("asked too soon", 0) + 1
            not_before = time.monotonic() + idle_wait(poll_s * rng.uniform(0.5, 1.5), asked, rng)  # as the agent
            if told is not None:
                told[index] = not_before
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
        if learner is None:
            log = part_log(lease["spec"], rng.randrange(2**31))
        else:
            init = await pool.get(stats, "init", lease["init"]["url"], token)
            if init is None or init.status_code != 200:
                continue
            log = await learner.log(index, load(init.content)["b_flat"], lease["spec"])
        files = {"log": log, "metrics": b"{}"}
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


def paced_wait(url: str, token: str) -> float:
    """The wait the server asks of an idle device of this population (its 204's Retry-After; 0: none)."""
    r = httpx.post(f"{url}/v1/leases", json={"eligible": False}, headers={"Authorization": f"Bearer {token}"})
    return float(r.headers.get("retry-after", 0)) if r.status_code == 204 else 0.0


def run_mode(url: str, admin: httpx.Client, cohort_id: int, tokens: list[str], mode: str, args) -> dict:
    """One job of ``mode`` on the trace for ``args.duration`` seconds → its row."""
    learner: Learner | None = getattr(args, "learner", None)
    hyper = LEARN_JOB if learner is not None else HYPER
    fed = {"rounds": 10_000, "clients_per_round": args.k, "round_timeout_s": args.round_timeout_s, "mode": mode}
    if mode == "buffered" and getattr(args, "max_staleness", None) is not None:
        fed["max_staleness"] = args.max_staleness
    job = admin.post(f"/v1/cohorts/{cohort_id}/jobs", json={**hyper, "seed": args.seed, **fed}).raise_for_status()
    job_id = job.json()["id"]
    while admin.get(f"/v1/jobs/{job_id}").json()["status"] in ("queued", "compiling"):
        time.sleep(0.2)
    trace = traces(len(tokens), args.seed, args.day_s, args.part_s, args.straggler_factor, args.dropout)
    stats, server, db = Stats(), ServerCpu(args.server_pid), DatabaseLoad(getattr(args, "database_url", None))
    cpu_here, started, started_at = time.process_time(), time.monotonic(), datetime.now(UTC)

    async def devices() -> None:
        pool = Connections(url, CONNECTIONS)
        stop_at = time.monotonic() + args.duration
        rngs = [random.Random(args.seed * 100_003 + i) for i in range(len(tokens))]
        await asyncio.gather(
            *(
                simulated_device(
                    pool,
                    t,
                    trace[i],
                    args.day_s,
                    stop_at,
                    stats,
                    rngs[i],
                    args.poll_s,
                    learner,
                    i,
                    args.spread_s,
                    args.told,
                )
                for i, t in enumerate(tokens)
            )
        )

    asyncio.run(devices())
    elapsed = time.monotonic() - started
    server_cpu, transactions = server.seconds(), db.transactions()
    admin.post(f"/v1/jobs/{job_id}/cancel")
    rounds = admin.get(f"/v1/jobs/{job_id}/rounds").raise_for_status().json()["data"]
    closed = [r for r in rounds if r["status"] == "closed"]
    clients = [c for r in rounds for c in r["clients"]]
    counted = sum(1 for c in clients if c["counted_in_round_id"] is not None)
    in_flight = sum(1 for c in clients if c["status"] == "leased")
    wasted = len(clients) - counted - in_flight  # expired (dropped, late, left behind) or reported and never counted
    asked = [a for a in stats.retry_after if a > 0]
    row = {
        "mode": mode,
        "devices": len(tokens),
        "seconds": round(elapsed, 1),
        "versions": len(closed),
        "versions_per_min": round(60 * len(closed) / elapsed, 2),
        "versions_per_hour": round(3600 * len(closed) / elapsed),
        "parts_leased": len(clients),
        "parts_accepted": stats.accepted,
        "verified_parts_per_s": round(stats.accepted / elapsed, 2),
        "parts_counted": counted,
        "parts_wasted": wasted,
        "parts_in_flight_at_end": in_flight,
        "wasted_fraction": round(wasted / max(len(clients), 1), 3),
        "dropped": stats.dropped,
        "refused": stats.refused,
        "server_errors": stats.errors,
        "error_kinds": stats.error_kinds,
        "requests": sum(map(len, stats.latency.values())),
        "no_work_answers": len(stats.retry_after),
        "retry_after_s": round(sum(asked) / len(asked), 1) if asked else 0,
        "bytes_per_accepted_part": round(stats.bytes / max(stats.accepted, 1)),
        "server_cpu_s": round(server_cpu, 1),
        "server_cpu_ms_per_device_min": round(1000 * server_cpu / len(tokens) / (elapsed / 60), 2),
        "db_transactions_per_device_min": None
        if transactions is None
        else round(transactions / len(tokens) / (elapsed / 60), 2),
        "simulator_cpu_s": round(time.process_time() - cpu_here, 1),
    }
    for kind, values in stats.latency.items():
        row |= percentiles(kind, values) if values else {}
    if learner is not None:
        row["curve"] = version_curve(rounds, started_at, learner, args.server_data)
    return row


class ServerCpu:
    """CPU seconds the server's processes (the API processes, their verify and compile workers) used since made."""

    def __init__(self, pids: int | list[int]) -> None:
        self.processes = [psutil.Process(pid) for pid in ([pids] if isinstance(pids, int) else pids)]
        self.start = self._total()

    def _total(self) -> float:
        total = 0.0
        for process in self.processes:
            for p in [process, *process.children(recursive=True)]:
                try:
                    total += sum(p.cpu_times()[:2])
                except psutil.NoSuchProcess:
                    pass
        return total

    def seconds(self) -> float:
        return self._total() - self.start


class DatabaseLoad:
    """Transactions the PostgreSQL database committed or rolled back since made (``pg_stat_database``; None on
    SQLite). The benchmark's schema is the database's only user while it runs alone."""

    def __init__(self, url: str | None) -> None:
        self.engine = None
        if url and url.startswith("postgresql"):
            from sqlalchemy import create_engine

            self.engine = create_engine(url, isolation_level="AUTOCOMMIT")
        self.start = self._count()

    def _count(self) -> int | None:
        if self.engine is None:
            return None
        from sqlalchemy import text

        query = "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()"
        with self.engine.connect() as conn:
            conn.execute(text("SELECT pg_stat_clear_snapshot()"))
            return int(conn.execute(text(query)).scalar_one())

    def transactions(self) -> int | None:
        """Transactions since made; the connection pool is closed after."""
        count = self._count()
        if self.engine is not None:
            self.engine.dispose()
        return None if count is None or self.start is None else count - self.start


def version_curve(rounds: list[dict], started_at: datetime, learner: Learner, server_data: Path) -> list[list[float]]:
    """[seconds since the devices started, held-out loss] of B_0 and of each closed version, in order."""

    def b(sha256: str) -> np.ndarray:
        return load((server_data / "adapters" / f"{sha256}.safetensors").read_bytes())["b_flat"]

    rounds = sorted(rounds, key=lambda r: r["index"])
    curve = [[0.0, learner.loss(b(rounds[0]["b_sha256"]))]]
    for r, following in zip(rounds, rounds[1:], strict=False):  # a version's B is the next round's start
        if r["status"] == "closed":
            closed = datetime.fromisoformat(r["closed_at"].replace("Z", "+00:00"))
            closed = closed if closed.tzinfo else closed.replace(tzinfo=UTC)
            curve.append([round((closed - started_at).total_seconds(), 2), learner.loss(b(following["b_sha256"]))])
    return curve


def time_to(curve: list[list[float]], target: float) -> float | None:
    """The first time the curve's loss is at or under ``target`` (None: never)."""
    return next((t for t, loss in curve if loss <= target), None)


def learning(rows: list[dict], target: float | None = None) -> dict:
    """Time to the held-out loss target, per mode: ``target``, or the loss the synchronous job's last version
    reached; and the ratio synchronous / buffered."""
    by_mode = {row["mode"]: row for row in rows if "curve" in row}
    if target is None:
        target = by_mode["sync"]["curve"][-1][1] if "sync" in by_mode else min(r["curve"][-1][1] for r in rows)
    out = {"target_loss": round(target, 4)} | {f"{m}_s": time_to(r["curve"], target) for m, r in by_mode.items()}
    if out.get("sync_s") and out.get("buffered_s"):
        out["sooner"] = round(out["sync_s"] / out["buffered_s"], 2)
    return out


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
    parser.add_argument(
        "--max-staleness", type=int, help="the buffered job's max staleness S (default: the server's, 4)"
    )
    parser.add_argument("--round-timeout-s", type=float, default=3600, help="a round's deadline after its first lease")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, help="model directory (default: a fresh tiny model)")
    parser.add_argument("--database-url", help="PostgreSQL base URL (a private schema is made); default SQLite")
    parser.add_argument("--workers", type=int, default=1, help="API processes (more than 1 needs --broker-url)")
    parser.add_argument(
        "--broker-url", help="Celery through this broker (redis:// or amqp://): compile and verify workers beside"
    )
    parser.add_argument(
        "--checkin-rate", type=float, help="the server's MOBIZO_CHECKIN_RATE (idle asks a second; default its own)"
    )
    parser.add_argument(
        "--learn",
        action="store_true",
        help="real parts: each device's steps on its own SST-2 shard; the held-out loss of every version",
    )
    parser.add_argument("--data-dir", type=Path, help="task data for --learn (default: the samples in data/)")
    parser.add_argument(
        "--target-loss", type=float, help="--learn: the held-out loss to reach (default: the synchronous job's last)"
    )
    parser.add_argument("--out", type=Path, help="write the rows as JSON here (and with --learn, population.png)")
    args = parser.parse_args()
    rows = run(args)
    print_table(rows)
    reached = learning(rows, args.target_loss) if args.learn else None
    if reached:
        print(f"time to held-out loss {reached['target_loss']}: " + json.dumps(reached))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(
            args.out / "population.json", json.dumps({"rows": rows, "learning": reached}, indent=2).encode()
        )
        if reached:
            plot(rows, reached, args.out / "population.png")


def plot(rows: list[dict], reached: dict, path: Path) -> None:
    """Held-out loss of each version against the seconds since the devices started, both modes on one axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for row, color in zip(rows, ("tab:blue", "tab:red"), strict=False):
        seconds, losses = zip(*row["curve"], strict=True)
        label = f"{row['mode']}: {row['versions']} versions, {row['wasted_fraction']:.0%} of parts wasted"
        ax.plot(seconds, losses, marker=".", color=color, label=label)
    ax.axhline(reached["target_loss"], color="grey", linestyle="--", linewidth=1, label="target")
    ax.set(xlabel="seconds since the devices started (simulated population)", ylabel="held-out loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_write(path, lambda handle: fig.savefig(handle, format="png", dpi=100))


def run(args) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = args.model
        if model is None:
            from shared.tiny_model import make_tiny_model

            model = make_tiny_model(tmp / "tiny", seed=0)
        if args.database_url:
            with pg_schema(args.database_url) as url:
                args.database_url = url  # the server's, and DatabaseLoad's
                return _run_on(url, tmp, model, args)
        return _run_on(f"sqlite:///{tmp / 'mobizo.db'}", tmp, model, args)


def _run_on(db_url: str, tmp: Path, model: Path, args) -> list[dict]:
    env = {"MOBIZO_LEASE_S": str(args.lease_s)}
    env |= {"MOBIZO_CHECKIN_RATE": str(args.checkin_rate)} if args.checkin_rate else {}
    if args.learn:
        args.learner = Learner(model, args.data_dir or task_data_dir(), SHARDS, tmp)
    data, log = tmp / "data", tmp / "server.log"
    verify = 2 if args.broker_url else 0  # with Celery, a verify worker of two processes beside the compile one
    with running_server(
        db_url, data, log, args.workers, args.broker_url, extra_env=env, pids=(pids := []), verify_workers=verify
    ) as url:
        return simulate(url, model, args, ADMIN, pids, data)


def simulate(
    url: str, model: Path, args, admin_token: str, server_pids: int | list[int], server_data: Path | None = None
) -> list[dict]:
    """Enroll the population on the server at ``url`` and run each of ``args.modes`` on its trace → the rows.
    ``server_data``: the server's data folder (where ``--learn`` reads the versions' B)."""
    args.server_pid, args.server_data = server_pids, server_data
    admin, cohort_id, tokens = enroll(url, model, args.devices, admin_token)
    args.spread_s = paced_wait(url, tokens[0])
    # When each device may ask again, as the server told it, kept across the modes' runs (the fleet runs on): the
    # probed device waits what it was told, and so does one told a wait just before a run ended.
    args.told = [0.0] * len(tokens)
    args.told[0] = time.monotonic() + args.spread_s
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
    "requests",
    "retry_after_s",
    "bytes_per_accepted_part",
    "server_cpu_s",
    "server_cpu_ms_per_device_min",
    "db_transactions_per_device_min",
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
