"""The ``adb`` backend: an Android phone runs the native runner (``device_agent/runner``); this machine drives it.

The runner, the program and its weights are pushed once each, under names that carry their sha256 (pushed to a
``.part`` name and renamed, so a name on the phone always means a whole file); a job's batches go to its own
folder. The runner's stdout lines stream into step records as it prints them. A stop is asked by creating the
runner's stop file (no signal crosses adb): it finishes the step, checkpoints on the phone and exits 75; the
checkpoint is then pulled here. To resume, the agent's checkpoint is pushed where the runner looks for it (and a
momentum or normalized program's state, rebuilt from the log, as ``--init-state``). A private job's clip and noise
for every step, drawn here from the device's private seed, go with the batches (``--private``).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

from device_agent.backends import OnStep, Outcome, ShouldStop, StepRecord, TrainRun
from device_agent.checkpoint import Checkpoint, decode, load_b, save_b, save_checkpoint
from shared.cpuinfo import parse_cpuinfo
from shared.errors import MobizoError
from shared.files import sha256_file
from shared.memory import meminfo_available_mb
from shared.schemas import CpuReport

PHONE_ROOT = "/data/local/tmp/mobizo"
EXIT_STOPPED = 75  # the runner's "stopped after finishing a step" (device_agent/runner/README.md)


class Phone:
    """``adb`` commands against one phone (``serial``, or the only one attached)."""

    def __init__(self, serial: str | None = None, adb: str = "adb") -> None:
        self.prefix = [adb, *(["-s", serial] if serial else [])]

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        try:
            done = subprocess.run([*self.prefix, *args], capture_output=True, text=True, check=False)
        except FileNotFoundError:
            raise MobizoError(f"{self.prefix[0]}: not found; install Android platform-tools") from None
        if check and done.returncode != 0:
            raise MobizoError(f"adb {args[0]} failed ({done.returncode}): {(done.stderr or done.stdout).strip()}")
        return done

    def shell(self, command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run("shell", command, check=check)

    def exists(self, path: str) -> bool:
        return self.shell(f"test -f {shlex.quote(path)}", check=False).returncode == 0

    def push_once(self, local: Path, remote: str) -> str:
        """Push ``local`` to ``remote`` unless a file is there already (names are content-addressed)."""
        if not self.exists(remote):
            part = shlex.quote(remote + ".part")
            self.run("push", str(local), remote + ".part")
            self.shell(f"mv {part} {shlex.quote(remote)}")
        return remote

    def pull(self, remote: str, local: Path) -> Path:
        self.run("pull", remote, str(local))
        return local

    def free_memory_mb(self) -> int | None:
        done = self.shell("cat /proc/meminfo", check=False)
        return meminfo_available_mb(done.stdout) if done.returncode == 0 else None

    def cpu(self) -> CpuReport | None:
        """The phone's CPU, from its /proc/cpuinfo (an Arm kernel's lists ``Features``); None if unreadable."""
        done = self.shell("cat /proc/cpuinfo", check=False)
        if done.returncode != 0:
            return None
        arch, features = parse_cpuinfo(done.stdout)
        return CpuReport(arch=arch, features=features)


class AdbBackend:
    name = "adb"

    def __init__(self, runner: Path, serial: str | None = None, root: str = PHONE_ROOT) -> None:
        self.runner = Path(runner)
        if not self.runner.is_file():
            raise MobizoError(f"{runner}: no runner binary (build it: device_agent/runner/build_android.sh)")
        self.phone = Phone(serial)
        self._cpu: CpuReport | None = None
        self.root = root

    def free_memory_mb(self) -> int | None:
        return self.phone.free_memory_mb()

    def cpu(self) -> CpuReport | None:
        """The phone's CPU, read over adb once (it does not change while this agent drives it), then remembered."""
        if self._cpu is None:
            self._cpu = self.phone.cpu()
        return self._cpu

    def _job_dir(self, run: TrainRun) -> str:
        return f"{self.root}/jobs/{run.key}"

    def recover(self, run: TrainRun) -> None:
        """Pull the phone's checkpoint of ``run`` over the local one (the phone's is the newest)."""
        remote = f"{self._job_dir(run)}/checkpoint.ckpt"
        if not self.phone.exists(remote):
            return
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = decode(self.phone.pull(remote, Path(tmp) / "c").read_bytes(), remote)
        if ckpt.job_id == run.key:
            save_checkpoint(run.checkpoint, ckpt)

    def forget(self, run: TrainRun) -> None:
        self.phone.shell(f"rm -rf {shlex.quote(self._job_dir(run))}", check=False)

    def _stage(
        self, run: TrainRun, start: int, start_b: np.ndarray | None, start_state: np.ndarray | None
    ) -> dict[str, str]:
        """Push what the runner needs; returns the phone paths by role."""
        job = self._job_dir(run)
        self.phone.shell(f"mkdir -p {self.root}/bin {self.root}/store {job} && rm -f {job}/STOP {job}/checkpoint.ckpt")
        paths = {
            "runner": self.phone.push_once(self.runner, f"{self.root}/bin/runner-{sha256_file(self.runner)[:16]}"),
            "program": self.phone.push_once(run.program, f"{self.root}/store/{run.manifest.pte.sha256}.pte"),
            "weights": self.phone.push_once(run.weights, f"{self.root}/store/{run.manifest.ptd.sha256}.ptd"),
            "job": job,
        }
        self.phone.run("push", str(run.batches), f"{job}/batches.mzb")
        with tempfile.TemporaryDirectory() as tmp:
            if start > 0:  # resume: the runner starts from a checkpoint of this run
                save_checkpoint(Path(tmp) / "c", Checkpoint(run.key, start, start_b))
                self.phone.run("push", str(Path(tmp) / "c"), f"{job}/checkpoint.ckpt")
            else:  # the program has no B of its own: the runner sets this one before step 1
                save_b(Path(tmp) / "init.f32", run.init_b)
                self.phone.run("push", str(Path(tmp) / "init.f32"), f"{job}/init.f32")
                paths["init"] = f"{job}/init.f32"
            extra = {"state": start_state, "private": _private_inputs(run)}  # optional inputs, raw float32
            for name, values in extra.items():
                if values is not None:
                    save_b(Path(tmp) / f"{name}.f32", values)
                    self.phone.run("push", str(Path(tmp) / f"{name}.f32"), f"{job}/{name}.f32")
                    paths[name] = f"{job}/{name}.f32"
        return paths

    def _command(self, run: TrainRun, paths: dict[str, str]) -> str:
        job = paths["job"]
        args = [
            paths["runner"],
            "--program",
            paths["program"],
            "--data",
            paths["weights"],
            "--batches",
            f"{job}/batches.mzb",
            "--eps",
            repr(run.eps),
            "--out-b",
            f"{job}/b.f32",
            "--checkpoint",
            f"{job}/checkpoint.ckpt",
            "--job-id",
            run.key,
            "--stop-file",
            f"{job}/STOP",
        ]
        if run.checkpoint_every:
            args += ["--checkpoint-every", str(run.checkpoint_every)]
        if run.manifest.inputs.widths is not None:  # each step at its longest row (batches.fit_width)
            args += ["--min-width", str(run.manifest.inputs.widths[0])]
        if "init" in paths:
            args += ["--init-b", paths["init"]]
        if "state" in paths:
            args += ["--init-state", paths["state"]]
        if "private" in paths:
            args += ["--private", paths["private"]]
        return " ".join(shlex.quote(a) for a in args)

    def train(
        self,
        run: TrainRun,
        start: int,
        start_b: np.ndarray | None,
        on_step: OnStep,
        should_stop: ShouldStop,
        start_state: np.ndarray | None = None,
    ) -> Outcome:
        paths = self._stage(run, start, start_b, start_state)
        stop_file = f"touch {paths['job']}/STOP"
        done = threading.Event()
        watcher = threading.Thread(target=_watch, args=(should_stop, lambda: self.phone.shell(stop_file), done))
        with tempfile.TemporaryFile("w+") as errors:  # a file, not a pipe: nobody reads stderr while steps stream
            proc = subprocess.Popen(
                [*self.phone.prefix, "shell", self._command(run, paths)],
                stdout=subprocess.PIPE,
                stderr=errors,
                text=True,
            )
            watcher.start()
            try:
                last = _stream_steps(proc, on_step, start)
                status = proc.wait()
            finally:
                done.set()
                watcher.join()
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            errors.seek(0)
            return self._finish(run, paths["job"], status, last, errors.read())

    def _finish(self, run: TrainRun, job: str, status: int, next_step: int, stderr: str) -> Outcome:
        if status == 0:
            with tempfile.TemporaryDirectory() as tmp:
                return Outcome(next_step, load_b(self.phone.pull(f"{job}/b.f32", Path(tmp) / "b.f32")))
        if status == EXIT_STOPPED:
            self.recover(run)
            return Outcome(next_step, None)
        raise MobizoError(f"the runner on the phone failed ({status}): {stderr.strip()[-2000:]}")


def _private_inputs(run: TrainRun) -> np.ndarray | None:
    """A private run's clip and noise of every step, step k's at k*(1+q) (the runner's ``--private``); None else."""
    if run.private is None:
        return None
    from device_agent.batches import BatchesFile

    steps = [run.private(k) for k in range(len(BatchesFile(run.batches)))]
    return np.concatenate([np.concatenate([[clip], noise]) for clip, noise in steps]).astype(np.float32)


def _watch(should_stop: ShouldStop, act, done: threading.Event, poll_s: float = 0.2) -> None:
    """Call ``act`` once when ``should_stop()`` turns true, unless ``done`` is set first."""
    while not done.wait(poll_s):
        if should_stop():
            act()
            return


def _stream_steps(proc: subprocess.Popen, on_step: OnStep, start: int) -> int:
    """Hand on each line the runner prints as a step record; returns the next step."""
    next_step = start
    for line in proc.stdout:
        record = json.loads(line)
        losses, g = (np.asarray(record[k], dtype=np.float64).astype(np.float32) for k in ("losses", "g"))
        lr = float(np.float32(record["lr"]))  # the runner prints the float32 lr of the step's record, %.9g
        # the phone's own time of the step's forward call, without adb's streaming
        on_step(StepRecord(int(record["step"]), int(record["seed"]), lr, losses, g, float(record["seconds"])))
        next_step = int(record["step"]) + 1
    return next_step


class AdbGenerator:
    """Greedy generation on the phone: the native runner's generate mode on the inference program (pushed once,
    by sha256, like training programs) and the adapter's B; one step per line read as the runner prints it."""

    def __init__(self, runner: Path, serial: str | None = None, root: str = PHONE_ROOT) -> None:
        if not Path(runner).is_file():
            raise MobizoError(f"{runner}: no runner binary (build it: device_agent/runner/build.sh)")
        self.runner, self.phone, self.root = Path(runner), Phone(serial), root

    def generate(self, fetched, prompt_ids: list[int], max_new_tokens: int, stop_ids):
        """Yield ``shared.generation.Generated`` per new token (the phone's own step times)."""
        from shared.generation import Generated

        self.phone.shell(f"mkdir -p {self.root}/bin {self.root}/store {self.root}/inference")
        runner = self.phone.push_once(self.runner, f"{self.root}/bin/runner-{sha256_file(self.runner)[:16]}")
        pte = self.phone.push_once(fetched.pte, f"{self.root}/store/{fetched.manifest.pte.sha256}.pte")
        ptd = self.phone.push_once(fetched.ptd, f"{self.root}/store/{fetched.manifest.ptd.sha256}.ptd")
        args = [runner, "generate", "--program", pte, "--data", ptd, "--prompt-ids", ",".join(map(str, prompt_ids))]
        args += ["--max-new-tokens", str(max_new_tokens)]
        if stop_ids:
            args += ["--stop-ids", ",".join(map(str, sorted(stop_ids)))]
        if fetched.b is not None:
            b_path = f"{self.root}/inference/b.f32"
            with tempfile.TemporaryDirectory() as tmp:
                save_b(Path(tmp) / "b.f32", fetched.b)
                self.phone.run("push", str(Path(tmp) / "b.f32"), b_path)
            args += ["--b", b_path]
        command = " ".join(shlex.quote(a) for a in args)
        proc = subprocess.Popen([*self.phone.prefix, "shell", command], stdout=subprocess.PIPE, text=True)
        for line in proc.stdout:
            step = json.loads(line)
            yield Generated(int(step["token"]), float(step["seconds"]))
        if proc.wait() != 0:
            raise MobizoError(f"the runner's generate mode failed on the phone (exit {proc.returncode})")
