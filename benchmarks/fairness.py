"""Does one tenant's load slow another tenant's requests? Another tenant's p50 and p95 for a lease,
``GET /v1/jobs``, a heartbeat and a (small, valid) result upload, while an attacker's devices upload without pause,
with 0 (idle), 1 and 6 attacking devices, side by side in one run. ``--attack replay`` (the default): long forged
logs, each a full replay in a verify worker before it is refused; ``--attack lapsed``: uploads to a job the device
holds no lease on, each refused with 409 before its body is read (paced and closed by ``server.limits``).

The server is the real app in a process of its own (uvicorn on loopback, SQLite, its real verify worker processes,
``verify_per_user`` 1) with the fake compile queue (programs are instant: the compile is not this benchmark's
subject). The attacker's devices loop without pause, each on a leased job of ``--attack-steps`` steps; a forged log
is well formed and replays in full, then is refused because its B is not the replay's.

    python -m benchmarks.fairness                      # about 4 minutes on 2 cores
    python -m benchmarks.fairness --attack lapsed --attackers 6
    python -m benchmarks.fairness --rounds 60 --attack-steps 20000
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from tests.server.factories import ADMIN_TOKEN, b_flat_bytes, bearer, fake_training, make_fake_model

VICTIM_JOB = {"model": "tiny", "task": "sst2", "q": 2, "batch_size": 4, "steps": 3, "rank": 2}
REQUESTS = ("lease", "GET /v1/jobs", "heartbeat", "upload")


def _serve(data_dir: str, sock: socket.socket) -> None:
    """The child process: the app (fake compiles, real verify workers) on ``sock``."""
    import uvicorn

    from server.app import create_app
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
    )
    app = create_app(settings, queue_factory=FakeCompileQueue().bind)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40, help="the victim's requests of each kind in each phase")
    parser.add_argument("--attack-steps", type=int, default=20_000, help="steps of each forged log (one replay each)")
    parser.add_argument("--attackers", type=int, nargs="+", default=[1, 6], help="attacker processes of each phase")
    parser.add_argument(
        "--attack",
        choices=("replay", "lapsed"),
        default="replay",
        help="replay: forged logs replayed in full, then refused; lapsed: uploads refused with 409 (no lease)",
    )
    args = parser.parse_args()
    attack_spec = {"model": "tiny", "task": "sst2", "q": 1, "batch_size": 1, "steps": args.attack_steps, "rank": 256}

    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        server = multiprocessing.get_context("spawn").Process(target=_serve, args=(str(tmp / "data"), sock))
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
            attacker = Tenant(url, admin, "attacker", max(args.attackers))
            measure(victim, 4)  # warm-up: both verify workers have imported torch
            phases = {0: measure(victim, args.rounds)}
            for attackers in args.attackers:
                with Attack(url, attacker, attackers, attack_spec, args.attack) as attack:
                    phases[attackers] = measure(victim, args.rounds)
                answers = dict(sorted(attack.answers.items(), key=str))
                if not answers:
                    raise RuntimeError("the attacker's processes sent nothing (see their tracebacks above)")
                print(f"{attackers} attacker process(es): the attacker's answers {answers}", flush=True)
        finally:
            server.terminate()
            server.join(30)
    idle = phases[0]
    columns = "".join(f" {t} attacker(s): p50 / p95 (ms, × idle) |" for t in phases if t)
    head = "| request | idle p50 / p95 (ms) |" + columns
    print(head + "\n|---|---|" + "---|" * (len(phases) - 1))
    for kind in REQUESTS:
        row = f"| {kind} | {p(idle[kind], 50):.1f} / {p(idle[kind], 95):.1f} |"
        for threads, figures in phases.items():
            if threads:
                p50, p95 = p(figures[kind], 50), p(figures[kind], 95)
                row += f" {p50:.1f} / {p95:.1f} ({p50 / p(idle[kind], 50):.1f}× / {p95 / p(idle[kind], 95):.1f}×) |"
        print(row)


if __name__ == "__main__":
    main()
