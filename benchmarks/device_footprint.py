"""What the device side costs a device: the install of ``mobizo[device]`` against the full stack, the idle agent's
memory, and a training step's memory (the agent and its native runner) against an inference forward's, on this
machine (x86-64) and on an emulated arm64 device (``scripts/arm64_device.sh``: a Debian arm64 root under
qemu-user), side by side in one run. MB are 2**20 bytes.

1. **Installs.** The closures of ``mobizo[device]``, ``mobizo[export]`` and ``mobizo[all]``
   (``benchmarks.install_closure``: the installed distributions' ``RECORD`` files, requirements walked with their
   markers and extras evaluated by the environment's own interpreter) in this benchmark's environment (the
   project's, ``mobizo`` editable), in a device-only venv made for the run (``uv venv`` + ``uv pip install
   '.[device]'``) and in the arm64 root's ``/opt/mobizo`` (the same code run by its Python under qemu), and each
   venv folder's whole size (pip, setuptools and bytecode included).
2. **The idle agent.** A real ``mobizo server`` (SQLite) with the model registered; on each device an agent
   enrolled with ``--backend native`` runs ``agent run --once --no-policy --poll-s 1`` with no job for
   ``--idle-s`` seconds: its ``VmRSS`` at the end and ``VmHWM`` (its peak since it started) from ``/proc``. On
   x86-64 the agent is the device-only venv's; on arm64 it is the root's Python under qemu, whose process holds the
   emulator too: its figures are the emulator's and the agent's together, not a device's.
3. **A step against inference.** A job of ``--steps`` steps is then submitted to that agent; while it trains, the
   agent's and its runner's (the agent's child, the self-contained bundle) ``VmRSS`` and ``VmHWM`` are read every
   ``--every-s`` seconds (the runner's ``VmHWM`` is its last reading before it exits: a step's memory is steady
   after the first; a fork of the agent before it execs the runner is neither). Then the job's own program runs in
   fresh runner processes on this machine (``benchmarks.runner_memory``: ``--fresh-steps`` steps at full width,
   and the runner's ``forward`` mode on the inference program of the same rows): their peak RSS (``ru_maxrss``)
   and the step's over the forward's. The aarch64 bundle runs there under qemu (binfmt) as well: its peaks include
   the emulator.

Times under qemu are not speed figures: none is printed or written for the emulated device.

    python -m benchmarks.device_footprint [--model DIR] [--idle-s 20] [--steps 200] [--no-arm64] [--json-out F]

Without ``--model`` a tiny model is made for the run (``mobizo make-tiny-model``). A real model, on this machine:
``--model models/smollm2 --q 4 --batch-size 16 --seq-len 64 --quantize 8da4w --steps 20 --no-arm64`` (the server
compiles its program first, and the inference program is exported too: minutes each; under qemu a SmolLM2 step
takes tens of times longer). The arm64 device needs root (debootstrap, chroot, binfmt) and the aarch64 bundle
(``bash device_agent/runner/build.sh --aarch64 --bundle``); ``--no-arm64`` measures this machine alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks import install_closure, runner_memory
from benchmarks.federation_agents import _ok, _wait_job
from benchmarks.server_load import ADMIN, REPO, running_server, wait_ready
from device_agent.runner_path import bundle_dir
from shared.manifest import read_manifest
from shared.tasks import task_data_dir

ARM64 = REPO / "scripts" / "arm64_device.sh"
ROLES = ("mobizo[device]", "mobizo[export]", "mobizo[all]")
RUNNER = "mobizo_runner"  # in the command line of a runner process (a bundle's mobizo_runner.bin) and its launcher
MB = 2**20


# --------------------------------------------------------------------------------------------------------------
# Installs


def closures(python: list[str], requirements: tuple[str, ...] = ROLES, cwd: Path | None = None) -> list[dict]:
    """``install_closure.closure`` of each requirement, computed by the interpreter ``python`` (a command line: an
    emulated device's runs through its launcher) on its own environment, isolated from this one (``-I``)."""
    source = Path(install_closure.__file__).read_text()
    done = subprocess.run(
        [*python, "-I", "-c", source, *requirements], capture_output=True, text=True, cwd=cwd, timeout=600
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(python)}: the closure failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def device_venv(folder: Path) -> Path:
    """A venv with this checkout's ``mobizo[device]`` alone, as a device installs it (uv: seconds) → its folder."""
    uv = [sys.executable, "-m", "uv"]
    subprocess.run([*uv, "venv", "--quiet", str(folder)], check=True, cwd=folder.parent)
    install = [*uv, "pip", "install", "--quiet", "--python", str(folder / "bin" / "python"), f"{REPO}[device]"]
    subprocess.run(install, check=True, cwd=folder.parent)
    return folder


def arm64_root() -> Path:
    """The emulated arm64 device's root, with this checkout's ``mobizo[device]`` in ``/opt/mobizo``."""
    done = subprocess.run(["bash", str(ARM64)], capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{ARM64}: {done.stderr[-3000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def install_row(label: str, closure: dict | None, folder: Path | None = None) -> dict:
    """A row of the installs' table: a closure's figures, or (``closure`` None) a whole folder's."""
    if closure is None:
        files, size = install_closure.folder_size(folder)
        return {"install": label, "distributions": None, "files": files, "bytes": size, "largest": []}
    largest = sorted(closure["distributions"], key=lambda d: -d["bytes"])[:6]
    if closure["missing"]:
        raise RuntimeError(f"{label}: required but not installed: {', '.join(closure['missing'])}")
    return {
        "install": label,
        "machine": closure["machine"],
        "distributions": len(closure["distributions"]),
        "files": closure["files"],
        "bytes": closure["bytes"],
        "names": sorted(d["name"] for d in closure["distributions"]),
        "largest": [f"{d['name']} {d['bytes'] / MB:.1f}" for d in largest],
    }


# --------------------------------------------------------------------------------------------------------------
# Processes' memory, from /proc


def proc_status(pid: int) -> dict[str, int] | None:
    """``VmRSS`` and ``VmHWM`` of ``pid`` in kB (None: gone, or a zombie without memory)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:  # exited meanwhile
        return None
    fields = dict(line.split(":", 1) for line in lines if line.startswith(("VmRSS:", "VmHWM:")))
    return {name: int(value.split()[0]) for name, value in fields.items()} if len(fields) == 2 else None


def children(pid: int) -> list[int]:
    """The processes any thread of ``pid`` started."""
    kids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            kids += [int(k) for k in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    except OSError:
        pass
    return kids


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _tree(pid: int) -> list[tuple[int, int, int]]:
    """``(pid, its parent, its depth)`` for ``pid`` and the processes below it, by depth."""
    tree = [(pid, 0, 0)]
    for parent, _, depth in tree:
        tree += [(kid, parent, depth + 1) for kid in children(parent)]
    return tree


def agent_and_runners(root: int) -> tuple[int | None, int, list[int]]:
    """In the tree of ``root`` (the agent, or a launcher whose chain of processes ends in it) → the agent, its
    depth, and the runners below it. The agent is the deepest process with ``agent`` among its arguments that is
    not a fork of it about to run something else (the same command line as its parent). A runner's command line
    names ``mobizo_runner`` (the agent's own names it too, as ``--runner``) and not ``agent``."""
    tree = _tree(root)
    lines = {pid: cmdline(pid) for pid, _, _ in tree}
    agent, depth = None, -1
    for pid, parent, level in tree:
        if "agent" in lines[pid] and lines[pid] != lines.get(parent):
            agent, depth = pid, level
    inside, runners = {agent}, []
    for pid, parent, _ in tree:  # parents before their children
        if parent in inside and pid != agent:
            inside.add(pid)
            if "agent" not in lines[pid] and any(RUNNER in arg for arg in lines[pid]):
                runners.append(pid)
    return agent, depth, runners


@dataclass
class Sample:
    t: float
    phase: str
    agent: dict[str, int] | None
    runners: dict[int, dict[str, int]]


@dataclass
class Watch:
    """Samples the agent's and its runners' memory every ``every_s`` seconds in a thread, tagged with ``phase``.
    The agent is the deepest one found so far: once it exits, the launcher above it is not taken for it."""

    root: int
    every_s: float
    phase: str = "idle"
    samples: list[Sample] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._done = threading.Event()
        self._agent, self._depth = None, -1
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self.every_s):
            agent, depth, runners = agent_and_runners(self.root)
            if agent is not None and depth >= self._depth:
                self._agent, self._depth = agent, depth
            statuses = {pid: s for pid in runners if (s := proc_status(pid)) is not None}
            ours = proc_status(self._agent) if self._agent == agent else None
            self.samples.append(Sample(time.monotonic(), self.phase, ours, statuses))

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def summary(self, phase: str) -> dict:
        """The phase's figures in MB: the agent's last VmRSS, its largest and its VmHWM; the largest runner's peak
        (its last VmHWM read) and largest VmRSS; the largest simultaneous sum of the agent's and runners' VmRSS."""
        ours = [s for s in self.samples if s.phase == phase and s.agent is not None]
        if not ours:
            raise RuntimeError(f"no reading of the agent while {phase}")
        runner_hwm: dict[int, int] = {}
        runner_rss: dict[int, int] = {}
        for s in ours:
            for pid, status in s.runners.items():
                runner_hwm[pid] = status["VmHWM"]  # the last reading: the peak up to then
                runner_rss[pid] = max(runner_rss.get(pid, 0), status["VmRSS"])
        top = max(runner_hwm, key=runner_hwm.get, default=None)
        return {
            "samples": len(ours),
            "runner_samples": sum(top in s.runners for s in ours) if top else 0,
            "agent_rss_mb": ours[-1].agent["VmRSS"] / 1024,
            "agent_max_rss_mb": max(s.agent["VmRSS"] for s in ours) / 1024,
            "agent_hwm_mb": ours[-1].agent["VmHWM"] / 1024,
            "runner_hwm_mb": runner_hwm[top] / 1024 if top else None,
            "runner_max_rss_mb": runner_rss[top] / 1024 if top else None,
            "runners": len(runner_hwm),
            "device_max_rss_mb": max(s.agent["VmRSS"] + sum(r["VmRSS"] for r in s.runners.values()) for s in ours)
            / 1024,
        }


# --------------------------------------------------------------------------------------------------------------
# The agents


@dataclass
class Device:
    """Where an agent runs: how ``mobizo`` starts there, its folder as it sees it (``home``) and as this machine
    does (``local``), and the runner bundle it is given."""

    name: str
    label: str
    mobizo: list[str]
    home: str
    local: Path
    bundle: Path
    emulated: bool

    def env(self, **extra: str) -> dict[str, str]:
        """This process's environment without its Python path (the device's mobizo is its own install's)."""
        return {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **extra}

    def path(self, *parts: str) -> str:
        return "/".join([self.home, *parts])

    def prepare(self, data: Path) -> None:
        """The device's data (SST-2's shipped rows) and runner bundle, under its folder."""
        (self.local / "data" / "sst2").mkdir(parents=True)
        shutil.copyfile(data / "sst2" / "train.jsonl", self.local / "data" / "sst2" / "train.jsonl")
        shutil.copytree(self.bundle, self.local / "runner")


def enroll(device: Device, url: str, user: httpx.Client) -> int:
    """``mobizo agent enroll --backend native`` on the device → its id on the server."""
    code = _ok(user.post("/v1/enrollment-codes", json={}), 201)["code"]
    command = [*device.mobizo, "agent", "enroll", "--server", url, "--backend", "native", "--name", device.name]
    done = subprocess.run(
        [*command, "--config", device.path("agent.json")],
        env=device.env(MOBIZO_ENROLLMENT_CODE=code),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{device.name}: enroll failed: {done.stderr[-2000:]}")
    (row,) = [d for d in _ok(user.get("/v1/devices"))["data"] if d["name"] == device.name]
    return row["id"]


def run_agent(device: Device, user: httpx.Client, spec: dict, args: argparse.Namespace, log: Path) -> dict:
    """The enrolled agent idle for ``args.idle_s`` seconds, then training one job of ``spec``: its figures."""
    command = [*device.mobizo, "agent", "run", "--once", "--no-policy", "--poll-s", "1"]
    command += ["--config", device.path("agent.json"), "--data-dir", device.path("data")]
    command += ["--work-dir", device.path("work"), "--runner", device.path("runner", RUNNER)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, env=device.env(), stdout=out, stderr=subprocess.STDOUT, cwd=log.parent)
    watch = Watch(proc.pid, args.every_s)
    try:
        time.sleep(args.idle_s)
        if proc.poll() is not None:
            raise RuntimeError(f"{device.name}: the agent exited ({proc.returncode}): {log.read_text()[-2000:]}")
        watch.phase = "training"
        job = _ok(user.post("/v1/jobs", json=spec), 202)
        proc.wait(timeout=args.job_timeout_s)
    finally:
        watch.stop()
        if proc.poll() is None:
            agent, _, _ = agent_and_runners(proc.pid)
            os.kill(agent or proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
    done = _wait_job(user, job["id"], timeout=60)
    training = watch.summary("training")
    if training["runners"] == 0:
        raise RuntimeError(f"{device.name}: its runner ended before it was read: give the job more --steps")
    return {
        "device": device.label,
        "emulated": device.emulated,
        "job": done["id"],
        "steps": spec["steps"],
        "idle": watch.summary("idle"),
        "training": training,
    }


def fresh_runs(pte: Path, inference: Path, device: Device, args: argparse.Namespace, folder: Path) -> dict:
    """The job's program in fresh processes of the device's runner bundle, here: a step's and the inference
    forward's peak on the same rows (``benchmarks.runner_memory``); an emulated runner's times are left out."""
    folder.mkdir()
    launcher = device.bundle / RUNNER
    batches = runner_memory.write_sst2_batches(pte, args.fresh_steps, folder)
    step = runner_memory.runner_peak(launcher, pte, batches, folder)
    forward = runner_memory.forward_peak(launcher, inference, batches, args.fresh_steps, folder)
    if device.emulated:
        for row in (step, forward):
            row.pop("seconds")
    return {"device": device.label, "emulated": device.emulated, "step": step, "forward": forward}


def job_program(data_dir: Path, folder: Path) -> Path:
    """The server's one compiled program, with its weights and tokenizer beside it (links) → its ``.pte``."""
    (pte,) = sorted((data_dir / "programs").glob("*/program.pte"))
    manifest = read_manifest(pte)
    folder.mkdir()
    for source in (pte, pte.with_suffix(".json")):
        os.link(source, folder / source.name)
    for ref in (manifest.ptd, manifest.tokenizer):
        os.link(data_dir / "blobs" / ref.file, folder / ref.file)
    return folder / pte.name


# --------------------------------------------------------------------------------------------------------------
# The run


def print_tables(installs: list[dict], agents: list[dict], fresh: list[dict], args: argparse.Namespace) -> None:
    print("| install | distributions | files | MB | largest distributions (MB) |")
    print("|---|---|---|---|---|")
    for r in installs:
        dists = "—" if r["distributions"] is None else r["distributions"]
        largest = ", ".join(r["largest"]) or "—"
        print(f"| {r['install']} | {dists} | {r['files']:,} | {r['bytes'] / MB:,.1f} | {largest} |")
    print()
    print("| device | process | while | VmRSS MB | largest VmRSS MB | VmHWM MB |")
    print("|---|---|---|---|---|---|")
    for a in agents:
        idle, train = a["idle"], a["training"]
        who = "qemu-aarch64 + agent" if a["emulated"] else "agent"
        runner = "qemu-aarch64 + runner" if a["emulated"] else "runner (the agent's child)"
        print(
            f"| {a['device']} | {who} | idle {args.idle_s:g} s, no job | {idle['agent_rss_mb']:.1f} "
            f"| {idle['agent_max_rss_mb']:.1f} | {idle['agent_hwm_mb']:.1f} |"
        )
        print(
            f"| {a['device']} | {who} | training {a['steps']} steps | — | {train['agent_max_rss_mb']:.1f} "
            f"| {train['agent_hwm_mb']:.1f} |"
        )
        print(
            f"| {a['device']} | {runner} | training ({train['runner_samples']} readings) | — "
            f"| {train['runner_max_rss_mb']:.1f} | {train['runner_hwm_mb']:.1f} |"
        )
        print(f"| {a['device']} | both | training | — | {train['device_max_rss_mb']:.1f} | — |")
    if fresh:
        print()
        print(f"| device | runner, fresh process ({args.fresh_steps} calls) | peak RSS MB | step ÷ forward |")
        print("|---|---|---|---|")
        for f in fresh:
            ratio = f["step"]["peak_mb"] / f["forward"]["peak_mb"]
            print(f"| {f['device']} | training step | {f['step']['peak_mb']:.1f} | {ratio:.2f} |")
            print(f"| {f['device']} | inference forward, the same rows | {f['forward']['peak_mb']:.1f} | |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="the model to register (default: a tiny one made for the run)")
    parser.add_argument("--q", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--quantize", default="none", help="the job's base linears: none, 8da4w")
    parser.add_argument("--steps", type=int, default=200, help="the job's steps (the runner must live to be read)")
    parser.add_argument("--idle-s", type=float, default=20.0, help="seconds the agent runs with no job")
    parser.add_argument("--every-s", type=float, default=0.01, help="seconds between readings of /proc")
    parser.add_argument("--fresh-steps", type=int, default=3, help="calls of each fresh runner process")
    parser.add_argument("--job-timeout-s", type=float, default=1800.0)
    parser.add_argument("--runner", type=Path, default=bundle_dir("x86_64"), help="this machine's runner bundle")
    parser.add_argument("--runner-aarch64", type=Path, default=bundle_dir("aarch64"), help="the aarch64 bundle")
    parser.add_argument("--no-arm64", action="store_true", help="measure this machine alone")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    bundles = [("--runner", args.runner, "")] + (
        [] if args.no_arm64 else [("--runner-aarch64", args.runner_aarch64, " --aarch64")]
    )
    for flag, bundle, build in bundles:
        if not (bundle / RUNNER).is_file():
            parser.error(
                f"{flag}: {bundle} is no runner bundle (build it: device_agent/runner/build.sh{build} --bundle)"
            )
    if args.model is not None and not (args.model / "config.json").is_file():
        parser.error(f"--model: {args.model} is no model folder (no config.json)")
    if args.steps < 1 or args.fresh_steps < 1 or args.idle_s <= 0 or args.every_s <= 0:
        parser.error("--steps and --fresh-steps must be at least 1, --idle-s and --every-s above 0")

    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        print("installs: a device-only venv (uv) ...", file=sys.stderr, flush=True)
        venv = device_venv(tmp / "device-venv")
        ours, export, everything = closures([sys.executable], cwd=tmp)
        (x86_device,) = closures([str(venv / "bin" / "python")], ("mobizo[device]",), cwd=tmp)
        installs = [
            install_row("mobizo[device], x86-64 device venv (uv)", x86_device),
            install_row("the whole x86-64 device venv folder", None, venv),
        ]
        root = None
        if not args.no_arm64:
            print("installs: the arm64 root (scripts/arm64_device.sh) ...", file=sys.stderr, flush=True)
            root = arm64_root()
            (arm,) = closures(["bash", str(ARM64), "run", "/opt/mobizo/bin/python"], ("mobizo[device]",))
            installs += [
                install_row("mobizo[device], arm64 /opt/mobizo (pip)", arm),
                install_row("the whole arm64 /opt/mobizo folder", None, root / "opt" / "mobizo"),
            ]
        installs += [
            install_row("mobizo[device], the project's venv (mobizo editable)", ours),
            install_row("mobizo[export], the project's venv", export),
            install_row("mobizo[all], the project's venv", everything),
            install_row("the whole project venv folder (dev tools too)", None, Path(sys.prefix)),
        ]

        model = args.model
        if model is None:
            model = tmp / "tiny"
            subprocess.run([sys.executable, "-m", "mobizo", "make-tiny-model", "--out", str(model)], check=True)
        devices = [
            Device(
                "x86-64", "x86-64", [str(venv / "bin" / "mobizo")], str(tmp / "x86"), tmp / "x86", args.runner, False
            )
        ]
        home = f"/root/mobizo-footprint-{uuid.uuid4().hex[:8]}"
        if root is not None:
            devices.append(
                Device(
                    "arm64",
                    "arm64 (qemu-user)",
                    ["bash", str(ARM64), "run", "mobizo"],
                    home,
                    root / home.lstrip("/"),
                    args.runner_aarch64,
                    True,
                )
            )
        data_dir = tmp / "server"
        agents, fresh = [], []
        spec = {
            "model": "bench",
            "task": "sst2",
            "q": args.q,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "quantize": args.quantize,
            "steps": args.steps,
            "eval_examples": 0,
        }
        try:
            with running_server(f"sqlite:///{tmp / 'mobizo.db'}", data_dir, tmp / "server.log") as url:
                admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=600)
                _ok(admin.post("/v1/models", json={"name": "bench", "path": str(model.resolve())}), 201)
                key = _ok(admin.post("/v1/users", json={"name": "footprint"}), 201)["api_key"]
                user = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=600)
                for i, device in enumerate(devices):
                    print(f"agents: {device.label} ...", file=sys.stderr, flush=True)
                    device.prepare(task_data_dir())
                    device_id = enroll(device, url, user)
                    if i == 0:  # the program compiled before any agent runs: a job of its config, cancelled
                        print("the server compiles the job's program ...", file=sys.stderr, flush=True)
                        first = _ok(user.post("/v1/jobs", json={**spec, "device_id": device_id}), 202)["id"]
                        wait_ready(user, first)
                        _ok(user.post(f"/v1/jobs/{first}/cancel"))
                    log = tmp / f"agent-{device.name}.log"
                    agents.append(run_agent(device, user, {**spec, "device_id": device_id}, args, log))
            pte = job_program(data_dir, tmp / "program")
            print("fresh runners: the inference program ...", file=sys.stderr, flush=True)
            inference = runner_memory.exported_inference(pte, tmp / "inference", parser)
            for device in devices:
                fresh.append(fresh_runs(pte, inference, device, args, tmp / f"fresh-{device.name}"))
        finally:
            for device in devices:
                if device.emulated:
                    shutil.rmtree(device.local, ignore_errors=True)
    print_tables(installs, agents, fresh, args)
    if args.json_out:
        args.json_out.write_text(json.dumps({"installs": installs, "agents": agents, "fresh": fresh}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
