"""The simulated federation of ``benchmarks/federation.py``, with real processes on loopback: a ``mobizo server``
(SQLite) and C ``mobizo agent run`` processes (executorch backend, the server's compiled program), each its own user
and cohort member holding a label-skewed SST-2 shard as its local data. A federated job of R rounds, K clients × N
local steps is submitted per run; the cohort adapter's held-out loss after each round is computed offline from the
B the server published (eager step module, the same A), against one device training alone for the same total steps
(R personal jobs of K·N steps on one agent, each starting from the last one's adapter: ``--init-adapter``).

The poisoned runs add a liar: one more member device, played by this script through the REST API as a device that
does not run our agent would (it leases a part as soon as a round opens, trains honestly on its own shard with the
eager step module, multiplies its g by 1000 or flips its sign — losses kept — and uploads the log alone). Its part
is one of the K of every round it wins; the table says how many it won and whether the server refused any of its
logs. Under fedavg, trimmed-mean and median.

    mobizo make-tiny-model --out /tmp/fed/tiny
    python -m benchmarks.federation_agents --model /tmp/fed/tiny --local-steps 5 --lr 0.05 --eval-limit 64 \\
        --shard-size 200 --data-dir DATA --json-out /tmp/fed/federation-agents.json

As in ``benchmarks/federation.py``, the shards come from DATA's ``sst2/train.jsonl``; the default 9 shards of 200
need more rows of one label than the samples shipped in ``data/`` hold.

Times are wall-clock; the agents and the server share the machine's cores.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from safetensors.numpy import load

from benchmarks.federation import (
    POISONS,
    Setup,
    _eval_batches,
    _held_out_loss,
    _local_log,
    _poison,
    _setup,
    _shards,
    federation_arguments,
)
from benchmarks.server_load import ADMIN, REPO, running_server
from shared.tasks import task_data_dir
from shared.train_log import log_line


def _ok(response: httpx.Response, code: int = 200) -> dict:
    if response.status_code != code:
        raise SystemExit(f"{response.request.method} {response.request.url}: {response.status_code} {response.text}")
    return response.json() if response.content else {}


class Federation:
    """The server, its admin, the cohort and the agents (one user, device and process each)."""

    def __init__(self, url: str, args: argparse.Namespace, tmp: Path, shards: list[Path]) -> None:
        self.url, self.args, self.tmp = url, args, tmp
        self.admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120)
        _ok(self.admin.post("/v1/models", json={"name": "tiny", "path": str(Path(args.model).resolve())}), 201)
        body = {"name": "sst2-skewed", "model": "tiny", "task": "sst2"}
        self.cohort = _ok(self.admin.post("/v1/cohorts", json=body), 201)["id"]
        self.users: list[httpx.Client] = []
        self.procs: list[subprocess.Popen] = []
        for i, shard in enumerate(shards):
            user = self._user(f"agent-{i}")
            config = self._enroll(user, f"agent-{i}")
            data = tmp / f"data-{i}" / "sst2"
            data.mkdir(parents=True)
            (data / "train.jsonl").write_bytes(shard.read_bytes())
            command = [sys.executable, "-m", "mobizo", "agent", "run", "--config", str(config)]
            command += ["--data-dir", str(data.parent), "--work-dir", str(tmp / f"work-{i}")]
            command += ["--poll-s", str(args.agent_poll_s), "--heartbeat-s", "2", "--no-policy"]
            with open(tmp / f"agent-{i}.log", "wb") as log:
                self.procs.append(subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
            _ok(user.post(f"/v1/cohorts/{self.cohort}/join"))
            self.users.append(user)

    def _user(self, name: str) -> httpx.Client:
        key = _ok(self.admin.post("/v1/users", json={"name": name}), 201)["api_key"]
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=120)

    def _enroll(self, user: httpx.Client, name: str) -> Path:
        code = _ok(user.post("/v1/enrollment-codes", json={}), 201)["code"]
        config = self.tmp / f"{name}.json"
        command = [sys.executable, "-m", "mobizo", "agent", "enroll", "--server", self.url, "--code", code]
        command += ["--backend", "executorch", "--name", name, "--config", str(config)]
        subprocess.run(command, cwd=REPO, check=True, capture_output=True)
        return config

    def liar(self) -> tuple[httpx.Client, httpx.Client]:
        """(the liar's user, its device client): a member whose device is this script."""
        user = self._user("mallory")
        token = json.loads(self._enroll(user, "mallory").read_text())["token"]
        _ok(user.post(f"/v1/cohorts/{self.cohort}/join"))
        return user, httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=120)

    def close(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait(timeout=60)


def _spec(args: argparse.Namespace) -> dict:
    return {
        "q": args.q,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "rank": args.rank,
        "alpha": 2.0 * args.rank,  # as benchmarks.federation's eval module
        "lr": args.lr,
        "eps": args.eps,
    }


def _wait_job(client: httpx.Client, job_id: int, timeout: float = 3600) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = _ok(client.get(f"/v1/jobs/{job_id}"))
        if job["status"] in ("succeeded", "failed", "cancelled"):
            if job["status"] != "succeeded":
                raise SystemExit(f"job {job_id}: {job['status']}: {job['error']}")
            return job
        time.sleep(0.2)
    raise SystemExit(f"job {job_id} still running after {timeout} s")


def _b(data_dir: Path, sha256: str) -> np.ndarray:
    return load((data_dir / "adapters" / f"{sha256}.safetensors").read_bytes())["b_flat"]


def _lie(device: httpx.Client, setup: Setup, shard: Path, factor: float, stop: threading.Event, seen: dict) -> None:
    """The liar's loop: lease a round part whenever one is free, train on its shard, poison g, upload the log."""
    while not stop.is_set():
        response = device.post("/v1/leases", json={"eligible": True})
        if response.status_code == 204:
            time.sleep(0.02)
            continue
        lease = _ok(response)
        init = load(device.get(lease["init"]["url"]).content)["b_flat"]
        spec = lease["spec"]
        records = _poison(_local_log(setup, init, shard, spec["seed"], spec["steps"]), factor)
        log = "".join(log_line(r) for r in records).encode()
        files = {"log": ("log.jsonl", io.BytesIO(log)), "metrics": ("metrics.json", io.BytesIO(b"{}"))}
        reply = device.post(f"/v1/work/part-{lease['round']['client_id']}/result", files=files)
        seen["leased"] += 1
        seen["accepted" if reply.status_code == 201 else "refused"] += 1
        if reply.status_code != 201:
            seen["reasons"].append(f"{reply.status_code} {reply.text[:200]}")


def federate(fed: Federation, setup: Setup, evals: list, data_dir: Path, method: str, liar=None) -> dict:
    """One federated job → held-out loss per round, replay seconds per client, round seconds, the liar's record."""
    args = fed.args
    body = {
        **_spec(args),
        "steps": args.local_steps,
        "rounds": args.rounds,
        "clients_per_round": args.per_round,
        "round_timeout_s": args.round_timeout_s,
        "aggregation": method,
        "trim_fraction": args.trim_fraction,
        "global_lr": args.global_lr,
    }
    seen = {"leased": 0, "accepted": 0, "refused": 0, "reasons": []}
    stop = threading.Event()
    thread = None
    if liar is not None:
        device, shard, factor = liar
        thread = threading.Thread(target=_lie, args=(device, setup, shard, factor, stop, seen), daemon=True)
        thread.start()
    started = time.perf_counter()
    try:
        job = _ok(fed.admin.post(f"/v1/cohorts/{fed.cohort}/jobs", json=body), 202)
        _wait_job(fed.admin, job["id"])
    finally:
        stop.set()
        if thread is not None:
            thread.join(timeout=120)
    seconds = time.perf_counter() - started
    rounds = _ok(fed.admin.get(f"/v1/jobs/{job['id']}/rounds"))["data"]
    curve = [_held_out_loss(setup, _b(data_dir, rounds[0]["b_sha256"]), evals)]
    for round_ in rounds:
        adapter = _ok(fed.users[0].get(f"/v1/adapters/{round_['adapter_id']}"))  # a member: users see adapters
        curve.append(_held_out_loss(setup, _b(data_dir, adapter["b_sha256"]), evals))
    replay_s = [c["replay_s"] for r in rounds for c in r["clients"] if c["status"] == "reported"]
    return {"curve": curve, "replay_s": replay_s, "seconds": seconds, "liar": seen if liar is not None else None}


def alone(fed: Federation, setup: Setup, evals: list, data_dir: Path) -> list[float]:
    """Agent 0 alone on its shard: R personal jobs of K·N steps, each from the previous one's adapter."""
    args, user = fed.args, fed.users[0]
    curve = [_held_out_loss(setup, np.zeros(setup.d, np.float32), evals)]
    previous = None
    for _ in range(args.rounds):
        body = {"model": "tiny", "task": "sst2", **_spec(args), "steps": args.per_round * args.local_steps}
        if previous is not None:
            body["init_adapter_id"] = previous
        job = _wait_job(user, _ok(user.post("/v1/jobs", json=body), 202)["id"])
        adapter = _ok(user.get(f"/v1/adapters/{job['adapter_id']}"))
        curve.append(_held_out_loss(setup, _b(data_dir, adapter["b_sha256"]), evals))
        previous = job["adapter_id"]
    return curve


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    federation_arguments(p, local_steps=5, shard_size=200, lr=0.05, eval_limit=64)
    p.add_argument("--round-timeout-s", type=float, default=300.0)
    p.add_argument("--methods", nargs="+", default=["fedavg", "trimmed-mean", "median"])
    p.add_argument("--agent-poll-s", type=float, default=0.5, help="the agents' lease polling (the liar polls faster)")
    return p.parse_args()


def main() -> None:
    import torch

    args = _parse()
    torch.set_num_threads(args.threads)
    task_data = args.data_dir or task_data_dir()
    setup = _setup(args)
    evals = _eval_batches(setup, task_data, args.eval_limit)
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        shards = _shards(task_data, args.clients + 1, args.shard_size, args.skew, tmp)  # shard 0: the liar's
        data_dir = tmp / "server"
        with running_server(f"sqlite:///{tmp / 'mobizo.db'}", data_dir, tmp / "server.log") as url:
            fed = Federation(url, args, tmp, shards[1:])
            try:
                runs = {"fedavg, honest": federate(fed, setup, evals, data_dir, "fedavg")}
                solo = alone(fed, setup, evals, data_dir)
                if args.poison:
                    _, device = fed.liar()
                    for method in args.methods:
                        for poison in args.poison:
                            liar = (device, shards[0], POISONS[poison])
                            runs[f"{method}, liar {poison}"] = federate(fed, setup, evals, data_dir, method, liar)
            finally:
                fed.close()
    _print(args, runs, solo)
    if args.json_out:
        args.json_out.write_text(json.dumps({"runs": runs, "alone": solo}, indent=2))


def _print(args: argparse.Namespace, runs: dict, solo: list[float]) -> None:
    print(
        f"held-out loss per round (C={args.clients} agent processes, K={args.per_round}, R={args.rounds}, "
        f"N={args.local_steps}, q={args.q}, batch {args.batch_size}, lr {args.lr}, eps {args.eps})"
    )
    heads = " | ".join(str(r) for r in range(args.rounds + 1))
    print(f"| run | {heads} | job s | liar parts (refused) |\n|---|{'---|' * (args.rounds + 3)}")
    for name, run in runs.items():
        cells = " | ".join(f"{v:.3f}" if math.isfinite(v) else "nan" for v in run["curve"])
        liar = run["liar"]
        liar_cell = "" if liar is None else f"{liar['leased']} ({liar['refused']})"
        print(f"| {name} | {cells} | {run['seconds']:.0f} | {liar_cell} |")
    print("| one device alone (K·N steps per round) | " + " | ".join(f"{v:.3f}" for v in solo) + " | | |")
    replays = [s for run in runs.values() for s in run["replay_s"]]
    print(
        f"\nserver replay seconds per client: median {np.median(replays):.4f}, max {np.max(replays):.4f} "
        f"({len(replays)} replays); per round (K clients): {np.median(replays) * args.per_round:.4f}"
    )


if __name__ == "__main__":
    main()
