"""The runner's transports (``device_agent.backends.transports``): this machine under a work folder (``LocalHost``)
and a phone over adb (``Phone``, on the stand-in), each the host its backend reports and reads its policy from."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from device_agent.backends.make import make_backend, make_host
from device_agent.backends.runner import RunnerFiles
from device_agent.backends.transports import LocalHost, Phone, ThisMachine
from device_agent.eligibility import Readings
from shared.errors import MobizoError, UsageError
from tests.device_agent.conftest import ADB_STANDIN_DIR
from tests.device_agent.test_eligibility import fake_sysfs
from tests.utils.processes import exited


def test_local_host_pushes_a_file_once_as_a_link_and_a_folder_whole(tmp_path: Path) -> None:
    host = LocalHost(tmp_path / "work")
    assert oct((tmp_path / "work").stat().st_mode & 0o777) == "0o700"  # a job's batches hold the user's tokens
    weights = tmp_path / "w.ptd"
    weights.write_bytes(b"weights")
    stored = Path(host.push_once(weights, f"{host.root}/store/abc.ptd"))
    assert stored.read_bytes() == b"weights" and stored.stat().st_ino == weights.stat().st_ino  # linked
    weights.unlink()
    weights.write_bytes(b"other")  # a new file at the name (a download renamed into place): the pushed one stays
    assert host.push_once(weights, str(stored)) == str(stored) and stored.read_bytes() == b"weights"
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    for name in ("a", "b"):
        (bundle / name).write_text(name)
    (bundle / "a").chmod(0o755)
    pushed = Path(host.push_once(bundle, f"{host.root}/bin/bundle-1"))
    assert sorted(p.name for p in pushed.iterdir()) == ["a", "b"] and os.access(pushed / "a", os.X_OK)
    assert sorted(p.name for p in pushed.parent.iterdir()) == ["bundle-1"]  # no part left beside it
    (bundle / "c").write_text("c")
    host.push_once(bundle, str(pushed))
    assert not (pushed / "c").exists()  # once: the name says what it holds


def test_local_host_runs_shell_commands_and_copies_files(tmp_path: Path) -> None:
    host = LocalHost(tmp_path / "work")
    assert host.shell(f"mkdir -p {host.root}/jobs/j && echo hi").stdout == "hi\n"
    with pytest.raises(MobizoError, match="no such thing"):
        host.shell("echo 'no such thing' >&2; exit 3")
    assert host.shell("exit 3", check=False).returncode == 3
    batches = tmp_path / "batches.mzb"
    batches.write_bytes(b"1")
    remote = host.push(batches, f"{host.root}/jobs/j/batches.mzb")
    batches.write_bytes(b"2")
    assert Path(remote).read_bytes() == b"1" and host.exists(remote) and not host.exists(f"{host.root}/nothing")
    assert host.pull(remote, tmp_path / "back").read_bytes() == b"1"


@pytest.mark.parametrize("under_nohup", [False, True], ids=["plain", "nohup"])
def test_a_killed_agent_takes_its_local_runner_with_it(tmp_path: Path, under_nohup: bool) -> None:
    """As a phone's runner is hung up when adb's connection drops, a runner this machine started dies with the
    agent's process, even one killed with SIGKILL, and even an agent started under ``nohup`` (SIGHUP ignored, which
    its children inherit)."""
    pid_file = tmp_path / "pid"
    started = f"sh -c 'echo $$ > {pid_file}; exec sleep 60'"
    ignore_hup = "import signal; signal.signal(signal.SIGHUP, signal.SIG_IGN); " if under_nohup else ""
    agent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"{ignore_hup}import subprocess, time; from device_agent.backends.transports import LocalHost; "
            f"LocalHost({str(tmp_path)!r}).start({started!r}, subprocess.PIPE, None); time.sleep(60)",
        ],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    pid = wait_until(lambda: pid_file.exists() and pid_file.read_text().strip() and int(pid_file.read_text()))
    try:
        assert not exited(pid)
        agent.send_signal(signal.SIGKILL)
        agent.wait(timeout=10)
        assert wait_until(lambda: exited(pid))
    finally:
        if not exited(pid):
            os.kill(pid, signal.SIGKILL)


def wait_until(condition, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            return value
        time.sleep(0.05)
    return value


def test_each_host_reads_its_own_policy_readings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The native backend's host reads this machine's sysfs; the adb backend's reads the phone's dumpsys (what the
    agent's training policy uses), whatever this machine's sysfs says."""
    sysfs = fake_sysfs(tmp_path / "sysfs", "Discharging", 15, 52000)
    want = Readings(False, 15.0, 52.0, None)
    assert ThisMachine().readings(sysfs) == LocalHost(tmp_path / "work").readings(sysfs) == want
    monkeypatch.setenv("MOBIZO_FAKE_DEVICE_ROOT", str(tmp_path / "phone"))
    monkeypatch.setenv("PATH", f"{ADB_STANDIN_DIR}{os.pathsep}{os.environ['PATH']}")
    assert Phone().readings(sysfs) == Readings(True, 90.0, 30.0, False)  # the stand-in's phone on its charger


def test_backends_are_built_with_their_hosts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOBIZO_FAKE_DEVICE_ROOT", str(tmp_path / "phone"))
    monkeypatch.setenv("PATH", f"{ADB_STANDIN_DIR}{os.pathsep}{os.environ['PATH']}")
    assert isinstance(make_host("adb"), Phone) and isinstance(make_host("native"), ThisMachine)
    assert isinstance(make_host("executorch"), ThisMachine) and not isinstance(make_host("native"), LocalHost)
    runner = tmp_path / "runner"
    runner.write_text("#!/bin/sh\n")
    native = make_backend("native", runner=runner, work_dir=tmp_path / "work")
    assert isinstance(native.host, LocalHost) and native.host.root == str((tmp_path / "work" / "native").resolve())
    assert native.host.free_memory_mb() > 0 and native.host.cpu() == ThisMachine().cpu()
    assert isinstance(make_backend("adb", runner=runner).host, Phone)
    with pytest.raises(UsageError, match="work folder"):
        make_backend("native", runner=runner)
    with pytest.raises(MobizoError, match="build.sh --aarch64 --bundle"):
        make_backend("adb", runner=tmp_path / "missing")
    (tmp_path / "folder").mkdir()
    with pytest.raises(MobizoError, match="not a runner bundle"):
        make_backend("native", runner=tmp_path / "folder", work_dir=tmp_path / "work")


def test_a_bundle_is_named_by_its_files_and_started_through_its_loader(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    for name in ("ld-linux-aarch64.so.1", "mobizo_runner.bin", "libc.so.6"):
        (bundle / name).write_bytes(name.encode())
    first = RunnerFiles(bundle, "build.sh").digest
    (bundle / "mobizo_runner").write_text("#!/bin/sh\n")  # its launcher, named as the runner: the bundle
    launcher = RunnerFiles(bundle / "mobizo_runner", "build.sh")
    assert launcher.path == bundle and launcher.name().startswith("bundle-")
    first = RunnerFiles(bundle, "build.sh").digest
    assert RunnerFiles(bundle, "build.sh").argv("/d/b") == [
        "/d/b/ld-linux-aarch64.so.1",
        "--library-path",
        "/d/b",
        "/d/b/mobizo_runner.bin",
    ]
    (bundle / "libc.so.6").write_bytes(b"another libc")
    assert RunnerFiles(bundle, "build.sh").digest != first
    (bundle / "libc.so.6").write_bytes(b"libc.so.6")
    (bundle / "libc.so.6").chmod(0o755)
    assert RunnerFiles(bundle, "build.sh").digest != first  # the mode is part of what is pushed
    single = RunnerFiles(bundle / "libc.so.6", "build.sh")
    assert single.argv("/d/runner-1") == ["/d/runner-1"] and single.name().startswith("runner-")
