"""Does one tenant's load slow another tenant's requests? Another tenant's p50 and p95 for a lease,
``GET /v1/jobs``, a heartbeat and a (small, valid) result upload, side by side in one run: idle, then while

- an attacker's devices upload without pause (``--attackers``: 1 and 6 devices). ``--attack replay`` (the default):
  long forged logs, each a full replay in a verify worker before it is refused; ``--attack lapsed``: uploads to a job
  the device holds no lease on, each refused with 409 before its body is read (paced and closed by
  ``server.limits``);
- one user submits private jobs from ``--private-threads`` threads (12), each submit with new numbers (so a new
  calibration of its noise), honouring the server's Retry-After when refused with 429;
- two users download merged models (``--merged``: adapters of a real tiny model, each in three dtypes, in turn),
  with the kept merges bounded at a few merges' bytes: the phase also reports the bytes in the store's ``merged/``
  (sampled, largest seen) and the API process's resident memory before and after, and its peak.

The server is the real app in a process of its own (uvicorn on loopback, SQLite, its real verify and privacy worker
processes, ``verify_per_user`` 1) with the fake compile queue (programs are instant: the compile is not this
benchmark's subject; its merges are real, in a worker process). The attacker's devices loop without pause, each on
a leased job of ``--attack-steps`` steps; a forged log is well formed and replays in full, then is refused because
its B is not the replay's.

    python -m benchmarks.fairness                      # every phase
    python -m benchmarks.fairness --attack lapsed --attackers 6 --private-threads 0 --no-merged
    python -m benchmarks.fairness --attackers --rounds 100   # private submits and merged downloads: 2 minutes
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from shared.backends import MERGE_DTYPES
from tests.server.factories import ADMIN_TOKEN, b_flat_bytes, bearer, fake_training, make_fake_model

VICTIM_JOB = {"model": "tiny", "task": "sst2", "q": 2, "batch_size": 4, "steps": 3, "rank": 2}
MIB = 1024 * 1024
REQUESTS = ("lease", "GET /v1/jobs", "heartbeat", "upload")


def _serve(data_dir: str, sock: socket.socket, merged_mb: tuple[float, float]) -> None:
    """The child process: the app (fake compiles, real merges in a worker process, real verify and privacy workers) on
    ``sock``; kept merges bounded at ``merged_mb`` (per user, in all)."""
    import uvicorn

    from server.app import create_app
    from server.pool import WorkerPool
    from server.settings import Settings
    from tests.server.factories import FakeCompileQueue

    settings = Settings(
        data_dir=Path(data_dir),
        admin_token=ADMIN_TOKEN,
        lease_s=3600,
        verify_workers=2,
        verify_per_user=1,
        max_active_jobs=100_000,
        max_compiles=100_000,
        merged_per_user_mb=merged_mb[0],
        merged_total_mb=merged_mb[1],
    )
    app = create_app(settings, queue_factory=FakeCompileQueue(merge_pool=WorkerPool(1)).bind)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


class Tenant:
    """A user and ``devices`` enrolled devices, each an HTTP client."""

    def __init__(self, url: str, admin: httpx.Client, name: str, devices: int) -> None:
        key = admin.post("/v1/users", json={"name": name}).raise_for_status().json()["api_key"]
        self.http = httpx.Client(base_url=url, headers=bearer(key), timeout=600)
        self.devices = []
        for i in range(devices):
            code = self.http.post("/v1/enrollment-codes", json={}).raise_for_status().json()["code"]
            token = httpx.post(f"{url}/v1/devices", json={"code": code, "name": f"{name}-{i}"}).json()["token"]
            self.devices.append(httpx.Client(base_url=url, headers=bearer(token), timeout=600))

    def lease(self, device: int, spec: dict) -> dict:
        return submit_and_lease(self.http, self.devices[device], spec)


def submit_and_lease(user: httpx.Client, device: httpx.Client, spec: dict) -> dict:
    """The user submits a job of ``spec`` (compiled at once) and the device leases it → the lease."""
    user.post("/v1/jobs", json=spec).raise_for_status()
    return device.post("/v1/leases").raise_for_status().json()


def upload(device: httpx.Client, job_id: int, b: np.ndarray, log: str, steps: int) -> httpx.Response:
    files = {
        "b_flat": ("b_flat.safetensors", b_flat_bytes(b)),
        "log": ("log.jsonl", log.encode()),
        "metrics": ("metrics.json", json.dumps({"steps": steps}).encode()),
    }
    return device.post(f"/v1/work/job-{job_id}/result", files=files)


def forged(spec: dict, d: int) -> tuple[np.ndarray, str]:
    """A well-formed log of the job (its seeds, lr and eps; g from random losses) and a B it does not give (zeros):
    the server replays it in full before refusing it."""
    from server.verify import expected_lr
    from shared.noise import step_seed
    from shared.train_log import log_line, log_record

    rng = np.random.default_rng(0)
    losses = rng.uniform(1, 2, size=(spec["steps"], 2 * spec["q"])).astype(np.float32)
    g = (losses[:, 0::2] - losses[:, 1::2]) / (np.float32(spec["eps"]) * np.float32(2))
    lines = (
        log_line(log_record(k, step_seed(spec["seed"], k), expected_lr(spec, k), spec["eps"], g[k], losses[k]))
        for k in range(spec["steps"])
    )
    return np.zeros(d, np.float32), "".join(lines)


def _attack(url: str, key: str, token: str, spec: dict, mode: str, stop, answers, ready) -> None:
    """One attacker process: a device of the attacker uploading forged logs of ``spec`` jobs without pause until
    ``stop`` is set: ``replay``, on a new lease after each refusal that followed a replay; ``lapsed``, to a job it
    holds no lease on, again and again. ``answers`` counts the statuses, ``ready`` gets an item once the first
    forged upload is about to go."""
    user = httpx.Client(base_url=url, headers=bearer(key), timeout=600)
    device = httpx.Client(base_url=url, headers=bearer(token), timeout=600)

    def lease() -> tuple[dict, np.ndarray, str]:
        leased = submit_and_lease(user, device, spec)
        return (leased, *forged(leased["spec"], leased["manifest"]["lora_size"]))

    leased, b, log = lease()
    if mode == "lapsed":  # a job of the attacker's that no device holds: every upload to it is refused with 409
        job = user.post("/v1/jobs", json=spec).raise_for_status().json()
        leased = {**leased, "job_id": job["id"]}
    ready.append(token[:8])
    while not stop.is_set():
        try:
            status = upload(device, leased["job_id"], b, log, spec["steps"]).status_code
        except httpx.TransportError:  # refused and closed while the body was still being sent: try again at once
            status = "closed"
        answers[status] = answers.get(status, 0) + 1
        if mode == "replay" and status not in (429, "closed"):
            leased, b, log = lease()


class Attack:
    """``processes`` of the attacker (processes, not threads: the victim's client in this process must not wait for
    the attacker's interpreter lock), each uploading forged logs of long jobs without pause until the block ends."""

    def __init__(self, url: str, attacker: Tenant, processes: int, spec: dict, mode: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._manager = ctx.Manager()
        self.stop, self.answers, self.ready = self._manager.Event(), self._manager.dict(), self._manager.list()
        key = attacker.http.headers["authorization"].removeprefix("Bearer ")
        tokens = [d.headers["authorization"].removeprefix("Bearer ") for d in attacker.devices[:processes]]
        self._processes = [
            ctx.Process(
                target=_attack, args=(url, key, token, spec, mode, self.stop, self.answers, self.ready), daemon=True
            )
            for token in tokens
        ]

    def __enter__(self) -> Attack:
        for process in self._processes:
            process.start()
        deadline = time.monotonic() + 300
        while len(self.ready) < len(self._processes):  # every attacker has its lease and forged log
            if time.monotonic() > deadline or not all(p.is_alive() for p in self._processes):
                raise RuntimeError("the attacker's processes did not start (see their tracebacks above)")
            time.sleep(0.2)
        time.sleep(2)  # their uploads are arriving and one is replaying
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for process in self._processes:
            process.join()
        self.answers = dict(self.answers)
        self._manager.shutdown()


def _retry_after(r: httpx.Response) -> float:
    return float(r.headers.get("retry-after", "1"))


def _submit_private(url: str, key: str, threads: int, stop, answers, ready) -> None:
    """One process of the submitting user: ``threads`` threads, each submitting private jobs with new numbers (a new
    calibration each) until ``stop`` is set, waiting Retry-After when refused with 429 or 503."""
    http = httpx.Client(base_url=url, headers=bearer(key), timeout=600)
    lock = threading.Lock()

    def loop(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            privacy = {"epsilon": round(rng.uniform(2, 8), 6), "min_examples": rng.randrange(1000, 100_000)}
            try:
                r = http.post("/v1/jobs", json={**VICTIM_JOB, "privacy": privacy})
            except httpx.TransportError:  # a keep-alive connection the server closed while this thread waited
                continue
            with lock:
                answers[r.status_code] = answers.get(r.status_code, 0) + 1
            if r.status_code in (429, 503):
                stop.wait(_retry_after(r))

    ready.append("private")
    workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def _download_merged(url: str, keys: list[str], adapters: list[list[int]], stop, answers, ready) -> None:
    """One process of two users downloading merged models of their ``adapters`` (each user's list), each in every
    dtype, in turn, until ``stop`` is set, waiting Retry-After while a merge builds (503) or waits (429)."""
    users = [httpx.Client(base_url=url, headers=bearer(key), timeout=600) for key in keys]
    wanted = [(user, a, dtype) for dtype in MERGE_DTYPES for user, ids in zip(users, adapters) for a in ids]
    ready.append("merged")
    turn = 0
    while not stop.is_set():
        user, adapter_id, dtype = wanted[turn % len(wanted)]
        try:
            r = user.get(f"/v1/adapters/{adapter_id}/merged", params={"dtype": dtype})
        except httpx.TransportError:  # a keep-alive connection the server closed while this process waited
            continue
        answers[r.status_code] = answers.get(r.status_code, 0) + 1
        if r.status_code in (429, 503):
            stop.wait(min(_retry_after(r), 1.0))
        else:
            turn += 1


class Load:
    """``target(*args, stop, answers, ready)`` in a process of its own (the victim's client in this process must not
    wait for its interpreter lock) until the block ends; ``answers`` counts its statuses."""

    def __init__(self, target, *args) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._manager = ctx.Manager()
        self.stop, self.answers, self.ready = self._manager.Event(), self._manager.dict(), self._manager.list()
        self._process = ctx.Process(target=target, args=(*args, self.stop, self.answers, self.ready), daemon=True)

    def __enter__(self) -> Load:
        self._process.start()
        deadline = time.monotonic() + 120
        while not self.ready:
            if time.monotonic() > deadline or not self._process.is_alive():
                raise RuntimeError("the load's process did not start (see its traceback above)")
            time.sleep(0.1)
        time.sleep(2)  # its requests are arriving
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self._process.join()
        self.answers = dict(sorted(self.answers.items()))
        self._manager.shutdown()


def rss_mib(pid: int) -> tuple[float, float]:
    """(resident, peak resident) MiB of process ``pid`` (``/proc/<pid>/status``: VmRSS, VmHWM)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return tuple(int(fields[name].split()[0]) / 1024 for name in ("VmRSS", "VmHWM"))


class DiskWatch:
    """The bytes in ``folder``, sampled every 0.1 s in a thread while the block runs → ``largest``, ``last``."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.largest, self.last = folder, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _bytes(self) -> int:
        total = 0
        for path in self.folder.iterdir():
            try:
                total += path.stat().st_size
            except FileNotFoundError:  # evicted between the listing and the stat
                pass
        return total

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            self.largest = max(self.largest, self._bytes())

    def __enter__(self) -> DiskWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.last = self._bytes()
        self.largest = max(self.largest, self.last)


def measure(victim: Tenant, rounds: int) -> dict[str, list[float]]:
    """``rounds`` of each of the victim's requests, in turn → milliseconds per kind."""
    seconds: dict[str, list[float]] = {kind: [] for kind in REQUESTS}
    for _ in range(rounds):
        victim.http.post("/v1/jobs", json=VICTIM_JOB).raise_for_status()
        start = time.perf_counter()
        lease = victim.devices[0].post("/v1/leases").raise_for_status().json()
        seconds["lease"].append(time.perf_counter() - start)
        b, log = fake_training(lease["spec"], lease["manifest"]["lora_size"])
        device = victim.devices[0]
        start = time.perf_counter()
        victim.http.get("/v1/jobs", params={"limit": 20}).raise_for_status()
        seconds["GET /v1/jobs"].append(time.perf_counter() - start)
        start = time.perf_counter()
        device.post(f"/v1/work/job-{lease['job_id']}/heartbeat", json={"step": 1}).raise_for_status()
        seconds["heartbeat"].append(time.perf_counter() - start)
        start = time.perf_counter()
        r = upload(device, lease["job_id"], b, log, VICTIM_JOB["steps"])
        seconds["upload"].append(time.perf_counter() - start)
        if r.status_code != 201:
            raise RuntimeError(f"the victim's upload answered {r.status_code}: {r.text[:300]}")
    return {kind: [1000 * s for s in values] for kind, values in seconds.items()}


def p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def _merging_users(url: str, admin: httpx.Client, model_dir: Path) -> tuple[list[str], list[list[int]]]:
    """Two users of the real tiny model ``tiny-real``, each with two adapters (fake trainings of their own seeds) →
    their keys and adapter ids."""
    admin.post("/v1/models", json={"name": "tiny-real", "path": str(model_dir)}).raise_for_status()
    keys, adapters = [], []
    for name in ("merger-a", "merger-b"):
        tenant = Tenant(url, admin, name, 1)
        ids = []
        for seed in (1, 2):
            lease = tenant.lease(0, {**VICTIM_JOB, "model": "tiny-real"})
            b, log = fake_training(lease["spec"], lease["manifest"]["lora_size"], seed=seed + 2 * len(keys))
            r = upload(tenant.devices[0], lease["job_id"], b, log, VICTIM_JOB["steps"]).raise_for_status()
            ids.append(r.json()["adapter_id"])
        keys.append(tenant.http.headers["authorization"].removeprefix("Bearer "))
        adapters.append(ids)
    return keys, adapters


def _merge_once(http: httpx.Client, adapter_id: int) -> None:
    """One merged download, waited for (the worker's first merge imports torch and transformers)."""
    deadline = time.monotonic() + 600
    while (r := http.get(f"/v1/adapters/{adapter_id}/merged")).status_code in (429, 503):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the warm-up merge did not finish: {r.text}")
        time.sleep(0.5)
    r.raise_for_status()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40, help="the victim's requests of each kind in each phase")
    parser.add_argument("--attack-steps", type=int, default=20_000, help="steps of each forged log (one replay each)")
    parser.add_argument(
        "--attackers", type=int, nargs="*", default=[1, 6], help="attacker processes of each upload phase (none: skip)"
    )
    parser.add_argument(
        "--attack",
        choices=("replay", "lapsed"),
        default="replay",
        help="replay: forged logs replayed in full, then refused; lapsed: uploads refused with 409 (no lease)",
    )
    parser.add_argument(
        "--private-threads", type=int, default=12, help="threads of the user submitting private jobs (0: no phase)"
    )
    parser.add_argument("--no-merged", dest="merged", action="store_false", help="no merged-download phase")
    args = parser.parse_args()
    attack_spec = {"model": "tiny", "task": "sst2", "q": 1, "batch_size": 1, "steps": args.attack_steps, "rank": 256}
    loads: list[tuple[str, dict, str, str]] = []  # phase, the load's answers, API RSS, merged/ on disk

    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        merged_mb = (1.0, 1.0)
        if args.merged:
            from shared.model_files import float32_bytes
            from shared.tiny_model import make_tiny_model

            tiny = make_tiny_model(tmp / "tiny")
            unit = float32_bytes(tiny) / MIB + 0.1  # a float32 merge, with its tokenizer and config
            merged_mb = (2.5 * unit, 3.5 * unit)  # a few merges' worth: the downloads keep evicting
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        ctx = multiprocessing.get_context("spawn")
        server = ctx.Process(target=_serve, args=(str(tmp / "data"), sock, merged_mb))
        server.start()
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    httpx.get(f"{url}/healthz").raise_for_status()
                    break
                except httpx.HTTPError:
                    if time.monotonic() > deadline or not server.is_alive():
                        raise RuntimeError("the server did not start") from None
                    time.sleep(0.2)
            admin = httpx.Client(base_url=url, headers=bearer(ADMIN_TOKEN), timeout=60)
            admin.post("/v1/models", json={"name": "tiny", "path": str(make_fake_model(tmp / "m"))}).raise_for_status()
            victim = Tenant(url, admin, "victim", 1)
            attacker = Tenant(url, admin, "attacker", max([1, *args.attackers]))
            measure(victim, 4)  # warm-up: both verify workers have imported torch
            phases = {"idle": measure(victim, args.rounds)}
            for attackers in (n for n in args.attackers if n > 0):
                with Attack(url, attacker, attackers, attack_spec, args.attack) as attack:
                    phases[f"{attackers} attacker(s)"] = measure(victim, args.rounds)
                answers = dict(sorted(attack.answers.items(), key=str))
                if not answers:
                    raise RuntimeError("the attacker's processes sent nothing (see their tracebacks above)")
                print(f"{attackers} attacker process(es): the attacker's answers {answers}", flush=True)
            if args.private_threads > 0:
                submitter = Tenant(url, admin, "submitter", 0)
                submitter.http.put("/v1/privacy", json={"epsilon": 1000}).raise_for_status()  # every job fits
                key = submitter.http.headers["authorization"].removeprefix("Bearer ")
                label = f"private submits ({args.private_threads} threads)"
                before = rss_mib(server.pid)[0]
                with Load(_submit_private, url, key, args.private_threads) as load:
                    phases[label] = measure(victim, args.rounds)
                loads.append((label, load.answers, f"{before:.0f} → {rss_mib(server.pid)[0]:.0f}", "-"))
            if args.merged:
                keys, adapters = _merging_users(url, admin, tiny)
                _merge_once(httpx.Client(base_url=url, headers=bearer(keys[0]), timeout=60), adapters[0][0])
                before = rss_mib(server.pid)[0]
                with DiskWatch(tmp / "data" / "merged") as disk, Load(_download_merged, url, keys, adapters) as load:
                    phases["merged downloads"] = measure(victim, args.rounds)
                rss, peak = rss_mib(server.pid)
                kept = f"{disk.largest / MIB:.1f} (bound {merged_mb[1]:.1f}), {disk.last / MIB:.1f} at the end"
                loads.append(("merged downloads", load.answers, f"{before:.0f} → {rss:.0f} (peak {peak:.0f})", kept))
        finally:
            server.terminate()
            server.join(30)
    idle = phases["idle"]
    columns = "".join(f" {phase}: p50 / p95 (ms, × idle) |" for phase in phases if phase != "idle")
    head = "| request | idle p50 / p95 (ms) |" + columns
    print(head + "\n|---|---|" + "---|" * (len(phases) - 1))
    for kind in REQUESTS:
        row = f"| {kind} | {p(idle[kind], 50):.1f} / {p(idle[kind], 95):.1f} |"
        for phase, figures in phases.items():
            if phase != "idle":
                p50, p95 = p(figures[kind], 50), p(figures[kind], 95)
                row += f" {p50:.1f} / {p95:.1f} ({p50 / p(idle[kind], 50):.1f}× / {p95 / p(idle[kind], 95):.1f}×) |"
        print(row)
    if loads:
        print("\n| phase | the load's answers | API process RSS (MiB) | merged/ on disk, largest seen (MiB) |")
        print("|---|---|---|---|")
        for label, answers, rss, kept in loads:
            print(f"| {label} | {answers} | {rss} | {kept} |")


if __name__ == "__main__":
    main()
