"""A small federation end to end, with real processes on loopback: a ``mobizo server`` (SQLite; its compile cache
holds the tiny model's program) and five ``mobizo agent`` processes, one per member user, training real ExecuTorch
programs on local SST-2 rows for three rounds. Checked against the server's own records and files:

- every round's B equals an offline recomputation from the accepted logs (replay each from B_r, mean of the deltas
  summed left to right in client order, B_r + ETA·mean), bit for bit, and each round starts from the last one's B;
- a client that vanishes mid-round does not stall its round past the deadline (the round closes with M reports; the
  test moves the deadline instead of waiting it out);
- its late upload is refused (409);
- a user who left the cohort gets no further round work;
- a non-member (and the user who left) cannot see or download the cohort's adapter (404); a member can.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.numpy import load

from tests.device_agent.stack import SPEC, Agent, Stack, ok, server_env, wait_for
from tests.server import live
from tests.server.factories import ADMIN_TOKEN, bearer, run_out_the_clock

pytestmark = pytest.mark.slow

# From a round's first lease; a round short of M is reopened once for as long again. Generous, so that no round of a
# slow machine closes early: the test never waits it out, it moves round 1's deadline (run_out_the_clock).
ROUND_TIMEOUT_S = 600.0
SWEEP_SLACK_S = 15.0  # the sweeper runs every 0.5 s; closing replays nothing, but packages one archive in a worker
FEDERATION = {"rounds": 3, "clients_per_round": 3, "min_clients": 2, "round_timeout_s": ROUND_TIMEOUT_S}
ETA = 0.5


def _user(stack: Stack, admin: httpx.Client, name: str) -> httpx.Client:
    key = ok(admin.post("/v1/users", json={"name": name}), 201)["api_key"]
    return httpx.Client(base_url=stack.url, headers=bearer(key), timeout=60)


def _agent(stack: Stack, user: httpx.Client, local_data: Path, name: str) -> Agent:
    stack.user = user  # Stack.enroll asks the code of its current user
    config = stack.enroll()
    return Agent(config, stack.tmp / f"work-{name}", local_data, stack.tmp / f"agent-{name}.log")


def _b(artifacts: Path, sha: str) -> np.ndarray:
    return load((artifacts / "adapters" / f"{sha}.safetensors").read_bytes())["b_flat"]


def _recompute(artifacts: Path, round_: dict) -> np.ndarray:
    import torch

    from shared.replay import replay
    from shared.train_log import read_log

    b_r = _b(artifacts, round_["b_sha256"])
    total, reported = None, [c for c in round_["clients"] if c["status"] == "reported"]
    for client in reported:
        log = read_log(artifacts / "logs" / f"{client['log_sha256']}.jsonl")
        delta = replay(torch.from_numpy(b_r.copy()), log).numpy() - b_r
        total = delta if total is None else total + delta
    return b_r + np.float32(ETA) * (total / np.float32(len(reported)))


def _warm_up(stack: Stack, users: dict[str, httpx.Client], agents: dict[str, Agent]) -> None:
    """One short personal job per user, so that every agent has loaded its runtime before the rounds' clocks run
    (a cold first run took minutes on a loaded machine)."""
    jobs = []
    for user in users.values():
        stack.user = user
        jobs.append((user, stack.submit(steps=2)))
    for user, job_id in jobs:
        stack.user = user  # Stack reads a job with its current user's key
        assert stack.wait_job(job_id, {"succeeded", "failed"}, timeout=900)["status"] == "succeeded"


def _round_status(admin: httpx.Client, job_id: int, index: int) -> str | None:
    listed = ok(admin.get(f"/v1/jobs/{job_id}/rounds"))["data"]
    return listed[index]["status"] if len(listed) > index else None


def _reported(admin: httpx.Client, job_id: int, index: int) -> int:
    listed = ok(admin.get(f"/v1/jobs/{job_id}/rounds"))["data"]
    return len([c for c in listed[index]["clients"] if c["status"] == "reported"]) if len(listed) > index else 0


def _leased(agent: Agent, index: int) -> bool:
    return any(e["event"] == "leased" and e.get("round") == index for e in agent.events())


def _device_client(url: str, agent: Agent) -> httpx.Client:
    """The REST client an agent's device uses (its own token)."""
    return httpx.Client(base_url=url, headers=bearer(json.loads(agent.config.read_text())["token"]), timeout=60)


def _lease_round(device: httpx.Client, index: int) -> bool:
    """Ask for work as the device does; True once it holds a part in round ``index`` (earlier rounds are full)."""
    response = device.post("/v1/leases", json={"backend": "executorch"})
    assert response.status_code in (200, 204), response.text
    if response.status_code == 204:
        time.sleep(0.2)  # the agents' own poll interval (AGENT_FLAGS --poll-s)
        return False
    lease = response.json()
    assert lease["round"] is not None and lease["round"]["index"] == index, lease
    return True


def _time(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def test_a_federation_of_real_agents(artifacts: Path, local_data: Path, tiny_model_dir: Path, tmp_path: Path):
    env = server_env(artifacts, tmp_path / "db.sqlite")
    with live.server_process(env, tmp_path / "server.log") as url:
        stack = Stack(url, artifacts, tmp_path, tiny_model_dir)
        admin = httpx.Client(base_url=url, headers=bearer(ADMIN_TOKEN), timeout=60)
        cohort = ok(admin.post("/v1/cohorts", json={"name": "sst2-fed", "model": "tiny", "task": "sst2"}), 201)["id"]
        # Every agent runs (warm) from the start; joining the cohort is what brings a user's device work, so the
        # test decides who takes part in which round by who is a member when.
        names = ("alpha", "bravo", "charlie", "victim", "lefty")
        users = {name: _user(stack, admin, name) for name in names}
        outsider = _user(stack, admin, "outsider")
        agents = {name: _agent(stack, user, local_data, name) for name, user in users.items()}
        hyper = {k: v for k, v in SPEC.items() if k not in ("model", "task", "eval_examples")}
        try:
            for agent in agents.values():
                agent.start(once=False)
            _warm_up(stack, users, agents)
            for name in ("alpha", "bravo", "lefty"):
                ok(users[name].post(f"/v1/cohorts/{cohort}/join"))
            body = {**hyper, "steps": 4, "global_lr": ETA, **FEDERATION}
            job = ok(admin.post(f"/v1/cohorts/{cohort}/jobs", json=body), 202)
            # round 0: lefty, alpha and bravo; lefty leaves as soon as it has its part (which it finishes)
            wait_for(lambda: _leased(agents["lefty"], 0), 300, "lefty's part in round 0")
            ok(users["lefty"].post(f"/v1/cohorts/{cohort}/leave"))
            wait_for(lambda: _leased(agents["alpha"], 0) and _leased(agents["bravo"], 0), 300, "round 0's parts")
            # round 1: the victim's device takes a part and vanishes (its agent, warm until now, is killed first and
            # the test leases as that device: a real agent finishes 4 tiny steps faster than a test can kill it);
            # the others report and the round closes at its deadline with M = 2 reports
            agents["victim"].stop()
            ok(users["victim"].post(f"/v1/cohorts/{cohort}/join"))
            victim_device = _device_client(url, agents["victim"])
            wait_for(lambda: _lease_round(victim_device, 1), 600, "the victim's part in round 1")
            wait_for(lambda: _reported(admin, job["id"], 1) == 2, 600, "the others' reports in round 1")
            assert _round_status(admin, job["id"], 1) == "open"  # K = 3 parts, 2 reports: it waits for its deadline
            run_out_the_clock(f"sqlite:///{tmp_path / 'db.sqlite'}", job["id"])
            wait_for(lambda: _round_status(admin, job["id"], 1) == "closed", 60, "round 1 to close without it")
            ok(users["charlie"].post(f"/v1/cohorts/{cohort}/join"))  # round 2: charlie takes part
            done = wait_for(
                lambda: (j := ok(admin.get(f"/v1/jobs/{job['id']}")))["status"] in ("succeeded", "failed") and j,
                900,
                "three rounds",
            )
            assert done["status"] == "succeeded", done["error"]
        finally:
            for agent in agents.values():
                agent.stop()
        assert done["federation_progress"]["round"] == 2 and done["federation_progress"]["last_mean_loss"] > 0
        rounds = ok(admin.get(f"/v1/jobs/{job['id']}/rounds"))["data"]
        assert [r["status"] for r in rounds] == ["closed"] * 3

        # the killed client did not stall round 1 past its deadline, and its late upload is refused
        first = rounds[1]
        victim_id = int(json.loads(agents["victim"].config.read_text())["device_id"])
        (victim_part,) = [c for c in first["clients"] if c["device_id"] == victim_id]
        assert victim_part["status"] == "expired"
        assert len([c for c in first["clients"] if c["status"] == "reported"]) == 2
        assert _time(first["closed_at"]) <= _time(first["deadline_at"]) + timedelta(seconds=SWEEP_SLACK_S)
        late = victim_device.post(
            f"/v1/work/part-{victim_part['id']}/result",
            files={"log": ("log.jsonl", b"{}\n"), "metrics": ("metrics.json", b"{}")},
        )
        assert late.status_code == 409, late.text

        # lefty took part in round 0 only, after which it had left
        lefty_device = int(json.loads(agents["lefty"].config.read_text())["device_id"])
        assert [r["index"] for r in rounds if lefty_device in {c["device_id"] for c in r["clients"]}] == [0]
        assert [e["round"] for e in agents["lefty"].events() if e["event"] == "leased" and "round" in e] == [0]
        reported = [len([c for c in r["clients"] if c["status"] == "reported"]) for r in rounds]
        assert reported[1] == 2 and min(reported) >= FEDERATION["min_clients"]

        # every round's B is the offline recomputation from its accepted logs, bit for bit
        for index, round_ in enumerate(rounds):
            adapter = ok(users["alpha"].get(f"/v1/adapters/{round_['adapter_id']}"))
            assert (adapter["cohort_id"], adapter["round"], adapter["version"]) == (cohort, index, index + 1)
            stored, expected = _b(artifacts, adapter["b_sha256"]), _recompute(artifacts, round_)
            assert np.array_equal(stored.view(np.int32), expected.view(np.int32)), f"round {index}"
            if index + 1 < len(rounds):
                assert rounds[index + 1]["b_sha256"] == adapter["b_sha256"]
        assert np.abs(_b(artifacts, adapter["b_sha256"])).max() > 0

        # a member downloads the cohort adapter; a non-member and the user who left get 404
        last = rounds[-1]["adapter_id"]
        assert users["alpha"].get(f"/v1/adapters/{last}/download").status_code == 200
        for stranger in (outsider, users["lefty"]):
            assert stranger.get(f"/v1/adapters/{last}").status_code == 404
            assert stranger.get(f"/v1/adapters/{last}/download").status_code == 404


def _one_part_by_a_real_agent(stack: Stack, local_data: Path, job: dict) -> list[dict]:
    """A new cohort of the stack's user, a one-round one-client federated job (``job``: its steps and what else
    differs from the suite's ``SPEC``) trained and reported by a real agent → the job's rounds, once it succeeded."""
    import uuid

    admin = httpx.Client(base_url=stack.url, headers=bearer(ADMIN_TOKEN), timeout=60)
    name = f"cohort-{uuid.uuid4().hex[:8]}"
    cohort = ok(admin.post("/v1/cohorts", json={"name": name, "model": "tiny", "task": "sst2"}), 201)["id"]
    ok(stack.user.post(f"/v1/cohorts/{cohort}/join"))
    agent = Agent(stack.enroll(), stack.tmp / "work", local_data, stack.tmp / "agent.log")
    hyper = {k: v for k, v in SPEC.items() if k not in ("model", "task", "eval_examples")}
    body = {**hyper, **job, "rounds": 1, "clients_per_round": 1, "min_clients": 1}
    created = ok(admin.post(f"/v1/cohorts/{cohort}/jobs", json=body), 202)
    assert agent.start(once=True).wait(600) == 0, agent.tail()
    url = f"/v1/jobs/{created['id']}"
    done = wait_for(lambda: (j := ok(admin.get(url)))["status"] != "running" and j, 120, "the job")
    assert done["status"] == "succeeded", done["error"]
    return ok(admin.get(f"{url}/rounds"))["data"]


def test_a_real_agents_round_part_of_2000_steps_reports(stack: Stack, local_data: Path):
    """A round part whose log is far over the 64 KB JSON cap (2,000 steps at the suite's q = 4, about 0.5 MB),
    trained and uploaded by a real agent on the session's server, is replayed and accepted, and closes its round (a
    300-step part used to be refused 413 and expire). The log the server stored is the part's, step for step."""

    from server.limits import JSON_LIMIT
    from shared.train_log import read_log

    (round_,) = _one_part_by_a_real_agent(stack, local_data, {"lr": 0.01, "steps": 2000})
    (part,) = round_["clients"]
    assert part["status"] == "reported" and part["log_bytes"] > 5 * JSON_LIMIT, part
    log = read_log(stack.artifacts / "logs" / f"{part['log_sha256']}.jsonl")
    assert [record["step"] for record in log] == list(range(2000)) and all(len(r["g"]) == 4 for r in log)


def test_a_real_agent_trains_a_private_round_part(
    stack: Stack, local_data: Path, tiny_model_dir: Path, program_factory
) -> None:
    """A private federated job: the agent runs its part as a private run (the private program, noise from its own
    seed) and uploads g alone; the server accepts it as a private log and the cohort's adapter states each member's
    guarantee over rounds x local steps."""

    from shared.train_log import read_log
    from tests.utils.program_cache import seed_server_program

    private = {"epsilon": 8.0, "min_examples": 48}  # the device trains on 52 of its 64 rows (the rest held out)
    assert seed_server_program(stack.artifacts, tiny_model_dir, {**SPEC, "privacy": private}, program_factory).private
    (round_,) = _one_part_by_a_real_agent(stack, local_data, {"steps": 12, "privacy": private})
    (part,) = round_["clients"]
    assert part["status"] == "reported" and round_["mean_loss"] is None  # no loss left the device
    log = read_log(stack.artifacts / "logs" / f"{part['log_sha256']}.jsonl", private=True)
    assert len(log) == 12 and all(set(r) == {"step", "seed", "lr", "eps", "g"} for r in log)
    adapter = ok(stack.user.get(f"/v1/adapters/{round_['adapter_id']}"))
    assert adapter["privacy"]["steps"] == 12 and adapter["privacy"]["epsilon"] == 8.0
