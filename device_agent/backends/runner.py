"""The native runner (``device_agent/runner``) driven through a transport (``device_agent.backends.transports``):
the ``adb`` backend (an Android phone, ``Phone``) and the ``native`` backend (this machine, ``LocalHost``) are
this one driver on two transports.

``RunnerDriver`` runs any mode of the runner with files pushed: the runner itself (one binary, or a self-contained
bundle folder started through its own loader, ``build.sh --bundle``), programs and weights go once each under names
that carry their sha256, so a name there always means a whole file; scratch files go to a folder of their own.
``RunnerBackend`` trains with it (and measures a job's held-out points with the evaluate mode,
``device_agent.runner_evaluator``): a job's batches go to the job's folder, the runner's stdout lines stream into
step records as it prints them, a stop is asked by creating the runner's stop file (no signal crosses adb): it
finishes the step, checkpoints there and exits 75; the checkpoint is then pulled here. To resume, the agent's
checkpoint is pushed where the runner looks for it (and a momentum or normalized program's state, rebuilt from the
log, as ``--init-state``). A private job's clip and noise for every step, drawn here from the device's private seed,
go with the batches (``--private``). ``RunnerGenerator`` runs the generate mode.

Another mode plugs in the same way: push what it reads with ``store`` (content-addressed) or ``put`` (scratch),
then read its JSON lines with ``lines([mode, --flag, path, ...])``.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from device_agent.backends import OnStep, Outcome, ShouldStop, StepRecord, TrainRun
from device_agent.backends.transports import Transport
from device_agent.checkpoint import Checkpoint, decode, load_b, save_b, save_checkpoint
from shared.errors import MobizoError
from shared.files import sha256_file

if TYPE_CHECKING:
    from device_agent.runner_evaluator import RunnerEvaluator

EXIT_STOPPED = 75  # the runner's "stopped after finishing a step" (device_agent/runner/README.md)
BUNDLE_PROGRAM = "mobizo_runner.bin"  # the runner in a bundle
BUNDLE_LAUNCHER = "mobizo_runner"  # the bundle's launcher script, which stands for its bundle as ``--runner``


class RunnerFiles:
    """The runner as built: one binary (``build.sh``, ``build_android.sh``), or a bundle folder (``build.sh
    --bundle``: the runner, the libraries it needs and the glibc loader that starts it, which any Linux kernel,
    Android's included, runs as ``LOADER --library-path DIR DIR/mobizo_runner.bin``)."""

    def __init__(self, path: Path, hint: str) -> None:
        self.path = Path(path)
        if self.path.name == BUNDLE_LAUNCHER and (self.path.parent / BUNDLE_PROGRAM).is_file():
            self.path = self.path.parent  # a bundle's launcher names its bundle
        if self.path.is_dir():
            loaders = sorted(self.path.glob("ld-linux*"))
            if len(loaders) != 1 or not (self.path / BUNDLE_PROGRAM).is_file():
                raise MobizoError(f"{path}: not a runner bundle (no {BUNDLE_PROGRAM} and one ld-linux loader)")
            self.loader: str | None = loaders[0].name
        elif self.path.is_file():
            self.loader = None
        else:
            raise MobizoError(f"{path}: no runner binary (build it: {hint})")

    @cached_property
    def digest(self) -> str:
        """The sha256 of the binary; of a bundle, over its files' names, modes and contents."""
        if self.loader is None:
            return sha256_file(self.path)
        digest = hashlib.sha256()
        for file in sorted(p for p in self.path.rglob("*") if p.is_file()):
            executable = file.stat().st_mode & 0o111 != 0
            digest.update(f"{file.relative_to(self.path)}\0{executable:d}\0{sha256_file(file)}\n".encode())
        return digest.hexdigest()

    def name(self) -> str:
        return f"{'runner' if self.loader is None else 'bundle'}-{self.digest[:16]}"

    def argv(self, remote: str) -> list[str]:
        """How to start it once pushed to ``remote``: the binary, or the bundle's loader on its runner."""
        if self.loader is None:
            return [remote]
        return [f"{remote}/{self.loader}", "--library-path", remote, f"{remote}/{BUNDLE_PROGRAM}"]


class RunnerDriver:
    """Runs the native runner's modes on a transport, with the files they read pushed there."""

    def __init__(self, transport: Transport, runner: Path, hint: str = "device_agent/runner/build.sh") -> None:
        self.transport, self.runner = transport, RunnerFiles(runner, hint)

    @property
    def root(self) -> str:
        return self.transport.root

    def install(self) -> list[str]:
        """Push the runner (once: its name carries its hash) → the command that starts it there."""
        root = shlex.quote(self.root)
        self.transport.shell(f"mkdir -p {root}/bin {root}/store")
        return self.runner.argv(self.transport.push_once(self.runner.path, f"{self.root}/bin/{self.runner.name()}"))

    def store(self, local: Path, sha256: str, suffix: str) -> str:
        """Push a file once, named by its ``sha256`` (a program, weights) → its path there."""
        return self.transport.push_once(local, f"{self.root}/store/{sha256}{suffix}")

    def folder(self, name: str, clear: tuple[str, ...] = ()) -> str:
        """The folder ``name`` under the root, made if missing, the files ``clear`` in it removed → its path."""
        path = f"{self.root}/{name}"
        removes = "".join(f" && rm -f {shlex.quote(f'{path}/{file}')}" for file in clear)
        self.transport.shell(f"mkdir -p {shlex.quote(path)}{removes}")
        return path

    def put(self, local: Path, remote: str) -> str:
        return self.transport.push(local, remote)

    def put_f32(self, values: np.ndarray, remote: str) -> str:
        """Push raw float32 values (a B, a state, a private run's noise) → ``remote``."""
        with tempfile.TemporaryDirectory() as tmp:
            save_b(Path(tmp) / "v.f32", values)
            return self.put(Path(tmp) / "v.f32", remote)

    def start(self, argv: list[str], stderr) -> subprocess.Popen:
        """Start the runner there with ``argv`` (``install()``'s command and the mode's arguments); stdout streams."""
        return self.transport.start(" ".join(shlex.quote(a) for a in argv), subprocess.PIPE, stderr)

    def lines(self, args: list[str], what: str) -> Iterator[dict]:
        """Run a mode (``args``: the mode's name and flags) and yield its stdout's JSON lines as it prints them;
        MobizoError, with the end of its stderr, when it exits other than 0."""
        with tempfile.TemporaryFile("w+") as errors:  # a file, not a pipe: nobody reads stderr while lines stream
            proc = self.start([*self.install(), *args], errors)
            try:
                for line in proc.stdout:
                    yield json.loads(line)
                status = proc.wait()
            finally:
                if proc.poll() is None:  # the caller stopped reading early
                    proc.kill()
                    proc.wait()
            if status != 0:
                errors.seek(0)
                raise MobizoError(self.failure(what, status, errors.read()))

    def failure(self, what: str, status: int, stderr: str) -> str:
        return f"the runner's {what} failed on {self.transport.where} ({status}): {stderr.strip()[-2000:]}"


class RunnerBackend:
    """A ``Backend`` whose steps run in the native runner on ``transport``."""

    def __init__(self, name: str, transport: Transport, runner: Path, hint: str) -> None:
        self.name, self.host = name, transport
        self.driver = RunnerDriver(transport, runner, hint)

    def _job_dir(self, run: TrainRun) -> str:
        return f"{self.driver.root}/jobs/{run.key}"

    def recover(self, run: TrainRun) -> None:
        """Pull the runner's checkpoint of ``run`` over the local one (the runner's is the newest)."""
        remote = f"{self._job_dir(run)}/checkpoint.ckpt"
        if not self.host.exists(remote):
            return
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = decode(self.host.pull(remote, Path(tmp) / "c").read_bytes(), remote)
        if ckpt.job_id == run.key:
            save_checkpoint(run.checkpoint, ckpt)

    def forget(self, run: TrainRun) -> None:
        self.host.shell(f"rm -rf {shlex.quote(self._job_dir(run))}", check=False)

    def evaluator(self, run: TrainRun) -> RunnerEvaluator:
        """The run's held-out points measured by the runner's evaluate mode where it trains: the program and weights
        pushed once by content (as for training), the rows and B's into the job's folder (gone with it, ``forget``)."""
        from device_agent.runner_evaluator import RunnerEvaluator

        def invoke(args: list[str | Path]) -> Iterator[dict]:
            driver = self.driver
            job = driver.folder(f"jobs/{run.key}")
            stored = {
                run.program: driver.store(run.program, run.manifest.pte.sha256, ".pte"),
                run.weights: driver.store(run.weights, run.manifest.ptd.sha256, ".ptd"),
            }
            there = [
                a if isinstance(a, str) else stored.get(a) or driver.put(a, f"{job}/held-out-{a.name}") for a in args
            ]
            return driver.lines(there, "evaluate mode")

        return RunnerEvaluator(invoke, run.program, run.weights, run.manifest.inputs.widths)

    def _stage(
        self, run: TrainRun, start: int, start_b: np.ndarray | None, start_state: np.ndarray | None
    ) -> tuple[list[str], str]:
        """Push what the runner needs → (its command line, the job's folder there)."""
        driver = self.driver
        runner = driver.install()
        job = driver.folder(f"jobs/{run.key}", clear=("STOP", "checkpoint.ckpt"))
        program = driver.store(run.program, run.manifest.pte.sha256, ".pte")
        weights = driver.store(run.weights, run.manifest.ptd.sha256, ".ptd")
        driver.put(run.batches, f"{job}/batches.mzb")
        args = [*runner, "--program", program, "--data", weights, "--batches", f"{job}/batches.mzb"]
        args += ["--eps", repr(run.eps), "--out-b", f"{job}/b.f32", "--checkpoint", f"{job}/checkpoint.ckpt"]
        args += ["--job-id", run.key, "--stop-file", f"{job}/STOP"]
        if run.checkpoint_every:
            args += ["--checkpoint-every", str(run.checkpoint_every)]
        if run.manifest.inputs.widths is not None:  # each step at its longest row (batches.fit_width)
            args += ["--min-width", str(run.manifest.inputs.widths[0])]
        if start > 0:  # resume: the runner starts from a checkpoint of this run
            with tempfile.TemporaryDirectory() as tmp:
                save_checkpoint(Path(tmp) / "c", Checkpoint(run.key, start, start_b))
                driver.put(Path(tmp) / "c", f"{job}/checkpoint.ckpt")
        else:  # the program has no B of its own: the runner sets this one before step 1
            args += ["--init-b", driver.put_f32(run.init_b, f"{job}/init.f32")]
        extra = {"--init-state": start_state, "--private": _private_inputs(run)}  # optional inputs, raw float32
        for flag, values in extra.items():
            if values is not None:
                args += [flag, driver.put_f32(values, f"{job}/{flag.lstrip('-')}.f32")]
        return args, job

    def train(
        self,
        run: TrainRun,
        start: int,
        start_b: np.ndarray | None,
        on_step: OnStep,
        should_stop: ShouldStop,
        start_state: np.ndarray | None = None,
    ) -> Outcome:
        args, job = self._stage(run, start, start_b, start_state)
        stop_file = f"touch {shlex.quote(f'{job}/STOP')}"
        done = threading.Event()
        watcher = threading.Thread(target=_watch, args=(should_stop, lambda: self.host.shell(stop_file), done))
        with tempfile.TemporaryFile("w+") as errors:  # a file, not a pipe: nobody reads stderr while steps stream
            proc = self.driver.start(args, errors)
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
            return self._finish(run, job, status, last, errors.read())

    def _finish(self, run: TrainRun, job: str, status: int, next_step: int, stderr: str) -> Outcome:
        if status == 0:
            with tempfile.TemporaryDirectory() as tmp:
                return Outcome(next_step, load_b(self.host.pull(f"{job}/b.f32", Path(tmp) / "b.f32")))
        if status == EXIT_STOPPED:
            self.recover(run)
            return Outcome(next_step, None)
        raise MobizoError(self.driver.failure("training", status, stderr))


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
        # the device's own time of the step's forward call, without the transport's streaming
        on_step(StepRecord(int(record["step"]), int(record["seed"]), lr, losses, g, float(record["seconds"])))
        next_step = int(record["step"]) + 1
    return next_step


class RunnerGenerator:
    """Greedy generation in the runner's generate mode on the inference program (pushed once, by sha256, like
    training programs) and the adapter's B; one step per line read as the runner prints it."""

    def __init__(self, transport: Transport, runner: Path, hint: str) -> None:
        self.driver = RunnerDriver(transport, runner, hint)

    def generate(self, fetched, prompt_ids: list[int], max_new_tokens: int, stop_ids):
        """Yield ``shared.generation.Generated`` per new token (the device's own step times)."""
        from shared.generation import Generated

        driver = self.driver
        pte = driver.store(fetched.pte, fetched.manifest.pte.sha256, ".pte")
        ptd = driver.store(fetched.ptd, fetched.manifest.ptd.sha256, ".ptd")
        args = ["generate", "--program", pte, "--data", ptd, "--prompt-ids", ",".join(map(str, prompt_ids))]
        args += ["--max-new-tokens", str(max_new_tokens)]
        if stop_ids:
            args += ["--stop-ids", ",".join(map(str, sorted(stop_ids)))]
        if fetched.b is not None:
            args += ["--b", driver.put_f32(fetched.b, f"{driver.folder('inference')}/b.f32")]
        for step in driver.lines(args, "generate mode"):
            yield Generated(int(step["token"]), float(step["seconds"]))
