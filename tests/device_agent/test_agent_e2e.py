"""The agent end to end, with real processes on loopback: a ``mobizo server`` (uvicorn, SQLite; its compile cache
holds the tiny model's program) and ``mobizo agent`` processes that enroll, lease, download, train on local SST-2
rows and upload. What the issue asks of the agent, each checked against the server's own records:

- every backend (executorch, torch, adb with the stand-in phone, native: the runner on this machine) ends its job
  ``succeeded``, and the adapter the user downloads is ``mobizo replay`` of the log the server received, bit for
  bit;
- an agent killed with SIGKILL, and one stopped with SIGTERM, resume and upload the very B of an uninterrupted run;
- the server going away mid-job does not stop the job from succeeding;

Interruptions land at a known point, not by racing a long job: the test unplugs the device's (faked) charger, the
agent checkpoints and pauses mid-job, and the kill, the stop or the outage comes while it is paused.
- a cancelled job stops the agent within seconds;
- no request carries the training text, and a model's weights are downloaded once;
- a job the device cannot run fails with the device's reason; jobs go only to devices with the memory they need.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from device_agent.checkpoint import load_checkpoint
from mobizo.cli import main
from tests.device_agent.conftest import ADB_STANDIN_DIR
from tests.device_agent.stack import Agent, Stack, make_agent, ok, server_env, wait_for
from tests.device_agent.test_eligibility import fake_sysfs
from tests.server import live

pytestmark = pytest.mark.slow


def backend_setup(backend: str, tmp_path: Path, runner: Path, model_dir: Path) -> tuple[list[str], dict[str, str]]:
    """(extra ``agent run`` flags, extra environment) for a backend."""
    if backend == "torch":
        return ["--model-dir", str(model_dir), "--device", "cpu"], {}
    if backend == "adb":
        path = f"{ADB_STANDIN_DIR}{os.pathsep}{os.environ['PATH']}"
        env = {"MOBIZO_FAKE_DEVICE_ROOT": str(tmp_path / "phone"), "PATH": path}
        return ["--runner", str(runner)], env
    if backend == "native":
        return ["--runner", str(runner)], {}
    return [], {}


class Charger:
    """The device's charger, faked where the backend reads it (sysfs on Linux, ``dumpsys battery`` on the adb
    stand-in's phone, both re-read every 0.02 s): unplugging it makes a training agent checkpoint and pause within a
    step or two (executorch) or a fraction of a second (adb: the phone's runner is told to stop)."""

    def __init__(self, backend: str, tmp_path: Path, env: dict[str, str]) -> None:
        self.backend = backend
        if backend == "adb":
            self.file = Path(env["MOBIZO_FAKE_DEVICE_ROOT"]) / "dumpsys" / "battery.txt"
            self.flags = ["--policy-check-s", "0.02"]
        else:
            root = fake_sysfs(tmp_path / "sysfs")
            self.file = root / "sys/class/power_supply/BAT0/status"
            self.flags = ["--sysfs-root", str(root), "--policy-check-s", "0.02"]
        self.plug(True)

    def plug(self, plugged: bool) -> None:
        self.file.parent.mkdir(parents=True, exist_ok=True)
        if self.backend == "adb":
            self.file.write_text(f"  AC powered: {str(plugged).lower()}\n  level: 90\n  temperature: 300\n")
        else:
            self.file.write_text("Charging\n" if plugged else "Discharging\n")


def started(agent: Agent, job_id: int) -> None:
    """Wait until the agent has trained a few steps of the job (polled every 5 ms: a tiny step takes about 3)."""
    wait_for(lambda: agent.steps_logged(job_id) >= 3, 300, f"job {job_id} to train", every=0.005)


def pause_mid_job(agent: Agent, charger: Charger, job_id: int, steps: int) -> int:
    """Unplug once the job has trained a few steps; wait for the pause → the step it paused after, asserted to
    leave steps to run and to have its checkpoint there."""
    started(agent, job_id)
    charger.plug(False)
    paused = lambda: any(e["event"] == "paused" and e["job_id"] == job_id for e in agent.events())  # noqa: E731
    wait_for(paused, 60, "the pause")
    paused_at = agent.steps_logged(job_id)
    assert 3 <= paused_at < steps, f"paused at step {paused_at} of {steps}: no steps left to interrupt"
    assert checkpoint_of(agent, job_id).next_step == paused_at  # the checkpoint is where it paused
    return paused_at


def freeze_between_checkpoints(agent: Agent, job_id: int, steps: int) -> int:
    """Freeze the agent (SIGSTOP) mid-job, once it has passed a checkpoint (every 7 steps) → that checkpoint's
    step, asserted to lie behind steps already logged and ahead of steps still to run."""
    wait_for(lambda: agent.steps_logged(job_id) >= 9, 300, f"job {job_id} past a checkpoint", every=0.005)
    agent.proc.send_signal(signal.SIGSTOP)
    logged = agent.steps_logged(job_id)
    behind = checkpoint_of(agent, job_id).next_step
    assert logged < steps, f"frozen at step {logged} of {steps}: no steps left to interrupt"
    assert 0 < behind <= logged and behind % 7 == 0, (behind, logged)
    return behind


def wait_succeeded(stack: Stack, agent: Agent, *jobs: int) -> None:
    def done() -> bool:
        assert agent.proc.poll() is None, agent.tail()
        return all(stack.job(job)["status"] == "succeeded" for job in jobs)

    wait_for(done, 300, f"jobs {jobs} to succeed")


def assert_adapter_is_replay_of_uploaded_log(stack: Stack, job_id: int, tmp_path: Path) -> None:
    from shared.adapter import read_adapter, save_adapter

    downloaded = stack.download_adapter(job_id, tmp_path / "downloaded")
    config, lora_a, lora_b = read_adapter(downloaded)
    assert max(float(b.abs().max()) for b in lora_b.values()) > 0  # training moved B
    init = save_adapter(
        tmp_path / "init",
        lora_a,
        {n: b * 0 for n, b in lora_b.items()},
        config["r"],
        config["lora_alpha"],
        tuple(config["target_modules"]),
        "tiny",
    )
    log = stack.uploaded_log(job_id)
    assert (
        main(
            [
                "replay",
                "--init",
                str(init),
                "--log",
                str(log),
                "--out",
                str(tmp_path / "replayed"),
                "--compare",
                str(downloaded),
            ]
        )
        == 0
    )


@pytest.mark.parametrize("backend", ["executorch", "torch", "adb", "native"])
def test_job_succeeds_and_adapter_is_the_replay_of_the_uploaded_log(
    stack: Stack, local_data: Path, runner_binary: Path, tiny_model_dir: Path, tmp_path: Path, backend: str
) -> None:
    extra, env = backend_setup(backend, tmp_path, runner_binary, tiny_model_dir)
    job_id = stack.submit(steps=20)
    agent = make_agent(stack, local_data, backend, backend, extra, env)
    assert oct(agent.config.stat().st_mode & 0o777) == "0o600"  # the device token is private
    assert agent.start().wait() == 0, agent.tail()
    job = stack.job(job_id)
    assert job["status"] == "succeeded" and job["progress"]["step"] == 20
    metrics = stack.adapter(job_id)["metrics"]
    assert metrics["backend"] == backend and len(metrics["losses"]) == 20
    assert metrics["server"]["replay_max_abs_diff"] == 0.0
    assert_adapter_is_replay_of_uploaded_log(stack, job_id, tmp_path)
    assert not (agent.work / "jobs" / str(job_id)).exists()  # nothing of the job's data is left behind
    runner_jobs = agent.work / "native" / "jobs"  # the native runner's copies of a job's files: gone as well
    assert backend != "native" or (runner_jobs.is_dir() and not any(runner_jobs.iterdir()))


def training_starts(agent: Agent, job_id: int) -> list[int]:
    """The first step of each training session the agent logged for a job."""
    return [e["start"] for e in agent.events() if e["event"] == "training" and e["job_id"] == job_id]


def checkpoint_of(agent: Agent, job_id: int):
    from device_agent.job import run_key
    from shared.schemas import LeasePublic

    folder = agent.work / "jobs" / str(job_id)
    lease = LeasePublic.model_validate_json((folder / "lease.json").read_text())
    return load_checkpoint(folder / "checkpoint.ckpt", run_key(lease))


@pytest.mark.parametrize("backend", ["executorch", "adb"])
def test_killed_and_stopped_agents_resume_to_the_bits_of_an_uninterrupted_run(
    stack: Stack, local_data: Path, runner_binary: Path, tiny_model_dir: Path, tmp_path: Path, backend: str
) -> None:
    """Three jobs of one spec: one killed (SIGKILL) mid-job, one stopped (SIGTERM) mid-job, one left alone; the
    first two resume from their checkpoints and all three upload the same B and log, bit for bit.

    executorch: the agent is frozen (SIGSTOP) between two checkpoints, then killed, so log lines past the last
    checkpoint must be cut back and trained again. adb: the phone's runner runs apart from the agent and cannot be
    frozen with it, so the agent is killed while paused (its charger unplugged), its checkpoint where it paused."""
    # About a second of tiny steps in this process; the native runner is faster (400 in 0.85 s, done before the
    # unplugging took effect), so its jobs are longer.
    steps = 1500 if backend == "adb" else 400
    extra, env = backend_setup(backend, tmp_path, runner_binary, tiny_model_dir)
    charger = Charger(backend, tmp_path, env)
    agent = make_agent(stack, local_data, "device", backend, [*extra, *charger.flags], env)

    killed = stack.submit(steps)
    agent.start(once=False)
    if backend == "executorch":
        behind = freeze_between_checkpoints(agent, killed, steps)
    else:
        behind = pause_mid_job(agent, charger, killed, steps)
    agent.proc.send_signal(signal.SIGKILL)
    agent.wait()
    charger.plug(True)

    stopped = stack.submit(steps)
    agent.start(once=False)  # takes the killed job up from its folder, without a new lease; then the next one
    wait_succeeded(stack, agent, killed)
    assert training_starts(agent, killed) == [0, behind]  # resumed from its checkpoint, not started over
    started(agent, stopped)
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.wait(timeout=30) == 0, agent.tail()  # a clean stop ...
    ckpt = checkpoint_of(agent, stopped)
    assert ckpt.next_step == agent.steps_logged(stopped) < steps  # ... after checkpointing the step it finished

    plain = stack.submit(steps)
    agent.start(once=False)
    wait_succeeded(stack, agent, stopped, plain)
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.wait(timeout=30) == 0, agent.tail()
    assert training_starts(agent, stopped) == [0, ckpt.next_step]
    b_shas = {stack.adapter(job)["b_sha256"] for job in (killed, stopped, plain)}
    log_shas = {stack.adapter(job)["metrics"]["log_sha256"] for job in (killed, stopped, plain)}
    assert len(b_shas) == 1 and len(log_shas) == 1  # bit-identical B and log


def test_cancel_stops_the_agent_within_seconds(stack: Stack, local_data: Path) -> None:
    steps = 20000
    agent = make_agent(stack, local_data, "device")
    job_id = stack.submit(steps)
    agent.start()
    wait_for(lambda: (stack.job(job_id)["progress"]["step"] or 0) >= 50, 120, "heartbeats with progress")
    assert stack.job(job_id)["progress"]["steps_per_s"] > 0
    ok_cancel = stack.user.post(f"/v1/jobs/{job_id}/cancel")
    assert ok_cancel.status_code == 200, ok_cancel.text
    cancelled_at = time.monotonic()
    assert agent.wait(timeout=60) == 0, agent.tail()
    assert time.monotonic() - cancelled_at < 10  # a heartbeat every 0.5 s, then one step
    assert stack.job(job_id)["status"] == "cancelled"
    assert not (agent.work / "jobs" / str(job_id)).exists()
    assert "cancelled" in [e["event"] for e in agent.events()]


def test_server_down_for_a_while_mid_job(
    artifacts: Path, tiny_model_dir: Path, local_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server goes away while the agent is paused mid-job (its heartbeats fail); plugged in again, the agent
    trains on without the server, which comes back where the agent knows it: the job succeeds."""
    steps = 400
    env = server_env(artifacts, tmp_path / "db.sqlite")
    charger = Charger("executorch", tmp_path, {})
    with live.server_process(env, tmp_path / "server-1.log") as url:
        stack = Stack(url, artifacts, tmp_path, tiny_model_dir)
        job_id = stack.submit(steps)
        agent = make_agent(stack, local_data, "device", extra=charger.flags).start()
        paused_at = pause_mid_job(agent, charger, job_id, steps)
    wait_for(lambda: "heartbeat_failed" in [e["event"] for e in agent.events()], 60, "the agent to notice")
    charger.plug(True)  # trains on while the server is down
    wait_for(lambda: agent.steps_logged(job_id) > paused_at, 60, "training without the server")
    port = int(url.rsplit(":", 1)[1])
    monkeypatch.setattr(live, "free_port", lambda: port)  # the server comes back where the agent knows it
    with live.server_process(env, tmp_path / "server-2.log") as again:
        assert again == url
        assert agent.wait() == 0, agent.tail()
        assert stack.job(job_id)["status"] == "succeeded"
    assert agent.proc.returncode == 0


def test_no_request_carries_the_training_text(stack: Stack, local_data: Path, tmp_path: Path) -> None:
    """The agent in this process, its HTTP traffic recorded below httpx: bodies hold no training sentence. Two jobs
    of the same model: the weights are downloaded once."""
    import json

    import httpx

    from device_agent import api
    from device_agent.backends.make import make_backend
    from device_agent.config import load_config
    from device_agent.daemon import RunOptions, serve
    from device_agent.events import Reporter
    from device_agent.job import AgentContext

    sent: list[httpx.Request] = []

    class Recording(httpx.HTTPTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            request.read()
            sent.append(request)
            return super().handle_request(request)

    first, job_id = stack.submit(steps=10), stack.submit(steps=10, seed=4)
    cfg = load_config(stack.enroll())
    with api.client(cfg.server_url, cfg.token, transport=Recording()) as http:
        ctx = AgentContext(api.DeviceAPI(http), make_backend("executorch"), tmp_path / "work", local_data, Reporter())
        assert serve(ctx, RunOptions(once=True)) == 0
        assert serve(ctx, RunOptions(once=True)) == 0
    assert stack.job(first)["status"] == stack.job(job_id)["status"] == "succeeded"
    fetched = [r.url.path for r in sent if r.url.path.startswith("/v1/blobs/")]
    assert len(fetched) == len(set(fetched)) == 3  # program, weights, tokenizer: once each, cached by sha256
    texts = [json.loads(line)["sentence"].strip() for line in (local_data / "sst2" / "train.jsonl").open()]
    bodies = [request.content for request in sent]
    assert len(texts) == 64 and any(b'name="b_flat"' in body for body in bodies)  # the upload is in there
    leaked = [t for t in texts for body in bodies if t.encode() in body or json.dumps(t)[1:-1].encode() in body]
    assert leaked == []
    paths = {
        (r.method, r.url.path.replace(f"/job-{job_id}/", "/job-ID/").replace(f"/job-{first}/", "/job-ID/"))
        for r in sent
    }
    paths = {(method, "/v1/blobs/SHA" if path.startswith("/v1/blobs/") else path) for method, path in paths}
    assert paths == {
        ("POST", "/v1/leases"),
        ("GET", "/v1/blobs/SHA"),
        ("POST", "/v1/work/job-ID/result"),
    } | ({("POST", "/v1/work/job-ID/heartbeat")} & paths)


def test_a_job_the_device_cannot_run_fails_with_its_reason(stack: Stack, tmp_path: Path) -> None:
    (tmp_path / "no-data").mkdir()
    job_id = stack.submit(steps=5)
    agent = make_agent(stack, tmp_path / "no-data", "device")
    assert agent.start().wait() == 1, agent.tail()
    job = stack.job(job_id)
    assert job["status"] == "failed" and "no training data for task 'sst2'" in job["error"]


def test_jobs_are_leased_only_to_devices_with_the_memory_they_need(stack: Stack) -> None:
    from device_agent import api
    from device_agent.config import load_config

    job_id = stack.submit(steps=5)
    cfg = load_config(stack.enroll())
    with api.client(cfg.server_url, cfg.token) as http:
        device = api.DeviceAPI(http)
        assert isinstance(device.lease("executorch", memory_mb=0), api.NoWork)  # no free memory: nothing fits
        lease = device.lease("executorch", memory_mb=64_000)
    assert lease is not None and lease.job_id == job_id and 0 < lease.manifest.memory_mb < 64_000


def test_the_device_measures_its_adapter_on_held_out_data(stack: Stack, local_data: Path, capsys) -> None:
    """Accuracy and loss before, every ``eval_every`` steps and after training on a slice of the device's own
    data that it did not train on, uploaded with the result: in the job (``mobizo jobs show``) and in the
    adapter's registry entry."""
    import json

    job_id = stack.submit(steps=20, eval_examples=10, eval_every=8)
    agent = make_agent(stack, local_data, "held-out")
    assert agent.start().wait() == 0, agent.tail()
    data = [e for e in agent.events() if e["event"] == "data"]
    assert [(e["examples"], e["held_out"]) for e in data] == [(54, 10)]  # 64 local rows: 10 kept out of training
    key = stack.user.headers["authorization"].split()[1]
    assert main(["jobs", "show", str(job_id), "--server", stack.url, "--token", key]) == 0
    shown = json.loads(capsys.readouterr().out)
    held_out = shown["held_out"]
    assert held_out["n"] == 10 and held_out == stack.adapter(job_id)["held_out"]
    assert (held_out["before"]["step"], held_out["after"]["step"]) == (0, 20)
    assert held_out["before"]["loss"] != held_out["after"]["loss"]  # B moved (lr 0.5 on the tiny model)
    assert all(0 <= held_out[k]["accuracy"] <= 1 for k in ("before", "after"))
    curve = held_out["curve"]
    assert [e["step"] for e in curve] == [0, 8, 16, 20] and (curve[0], curve[-1]) == (
        held_out["before"],
        held_out["after"],
    )
    assert len({e["loss"] for e in curve}) == 4  # B_8 and B_16, rebuilt from the log, are not B_0 or B_20
    assert stack.adapter(job_id)["metrics"]["eval"] == curve


def test_a_private_job_uploads_noised_g_alone_and_its_log_replays(
    stack: Stack, local_data: Path, program_factory, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A private job (DP-ZO) end to end: the device samples its batches and draws its noise from a seed it keeps,
    its log holds g alone, every |g| within the server's bound, and the server's replay is the device's B bit
    for bit; its held-out figures stay on the device."""
    import json

    from server.verify import private_g_bound
    from tests.device_agent.stack import SPEC
    from tests.utils.program_cache import seed_server_program

    private = {"epsilon": 8.0, "min_examples": 64}  # the device holds 64 rows
    seeded = seed_server_program(stack.artifacts, tiny_model_dir, {**SPEC, "privacy": private}, program_factory)
    assert seeded.private
    job_id = stack.submit(steps=12, privacy=private)
    agent = make_agent(stack, local_data, "private")
    assert agent.start().wait() == 0, agent.tail()
    job = stack.job(job_id)
    assert job["status"] == "succeeded" and job["progress"]["loss"] is None  # no loss left the device
    lines = [json.loads(line) for line in stack.uploaded_log(job_id).read_text().splitlines()]
    assert len(lines) == 12 and all(set(line) == {"step", "seed", "lr", "eps", "g"} for line in lines)
    bound = private_g_bound(job["spec"] | {"answer_len": 1})
    assert max(abs(g) for line in lines for g in line["g"]) <= bound
    adapter = stack.adapter(job_id)
    metrics, shown = adapter["metrics"], job["spec"]["privacy"]
    assert metrics["losses"] is None and not metrics.get("eval") and metrics["server"]["replay_max_abs_diff"] == 0.0
    assert adapter["privacy"] == {  # the registry says what the adapter was trained under
        "epsilon": 8.0,
        "delta": shown["delta"],
        "noise_multiplier": shown["noise_multiplier"],
        "clip": shown["clip"],
        "steps": 12,
        "sampling_rate": job["spec"]["batch_size"] / 64,
    }
    listed = ok(stack.user.get("/v1/adapters"))["data"]
    assert [a["privacy"] for a in listed if a["id"] == adapter["id"]] == [adapter["privacy"]]
    assert_adapter_is_replay_of_uploaded_log(stack, job_id, tmp_path)
    assert not any("private_seed" in json.dumps(e) for e in agent.events())


def test_a_private_personal_job_trains_on_the_user_s_own_earlier_text(
    stack: Stack, program_factory, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A private (DP-ZO) personal job on the per-user text: the shipped Shakespeare sample's first user, the device
    folder ``benchmarks.personal_data`` writes (every speech of the user, with its cue). The device keeps its last
    fifth of speeches out of training (its later text, every row of them), trains on the rows of the others, uploads
    g alone, and the server's replay is its B bit for bit."""
    import json

    from benchmarks.personal_data import split, write_devices
    from shared.tasks import get_task
    from tests.utils.program_cache import seed_server_program
    from tests.utils.programs import TINY_TEXT, TINY_TEXT_JOB

    assert seed_server_program(stack.artifacts, tiny_model_dir, TINY_TEXT_JOB, program_factory) == TINY_TEXT
    user = split()[0]
    write_devices([user], tmp_path / "devices")
    job_id = stack.submit(steps=10, **TINY_TEXT_JOB, eval_examples=10_000)  # at most a fifth: the split's
    agent = make_agent(stack, tmp_path / "devices" / user.slug, "private-text")
    assert agent.start().wait() == 0, agent.tail()
    assert stack.job(job_id)["status"] == "succeeded"
    rows = [(sum(len(get_task("text").rows(r)) for r in part)) for part in (user.train, user.held_out)]
    assert [(e["examples"], e["held_out"]) for e in agent.events() if e["event"] == "data"] == [tuple(rows)]
    lines = [json.loads(line) for line in stack.uploaded_log(job_id).read_text().splitlines()]
    assert len(lines) == 10 and all(set(line) == {"step", "seed", "lr", "eps", "g"} for line in lines)
    assert_adapter_is_replay_of_uploaded_log(stack, job_id, tmp_path)
