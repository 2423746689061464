"""The adb stand-in: a folder plays the phone, and the host-built runner runs 'on' it through adb shell."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.device_agent.conftest import ADB_STANDIN_DIR
from tests.device_agent.helpers import Program, as_f32, python_reference, run_runner, runner_args
from tests.utils.processes import exited

PHONE_DIR = "/data/local/tmp/mobizo"


@pytest.fixture
def phone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "phone"
    monkeypatch.setenv("MOBIZO_FAKE_DEVICE_ROOT", str(root))
    monkeypatch.setenv("PATH", f"{ADB_STANDIN_DIR}{os.pathsep}{os.environ['PATH']}")
    return root


def adb(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["adb", *args], capture_output=True, text=True, timeout=60, check=False)
    if check:
        assert done.returncode == 0, done.stderr
    return done


def test_devices_lists_one_phone(phone: Path) -> None:
    assert adb("devices").stdout.splitlines()[1] == "mobizo-fake-device\tdevice"
    wrong = adb("-s", "other", "devices", check=False)
    assert wrong.returncode == 1 and "not found" in wrong.stderr


def test_push_pull_round_trip_keeps_bytes_and_mode(phone: Path, tmp_path: Path) -> None:
    tool = tmp_path / "tool"
    tool.write_bytes(b"#!/bin/sh\necho ok\n")
    tool.chmod(0o755)
    adb("push", str(tool), f"{PHONE_DIR}/bin/")
    assert (phone / "data/local/tmp/mobizo/bin/tool").read_bytes() == tool.read_bytes()
    assert adb("shell", f"{PHONE_DIR}/bin/tool").stdout == "ok\n"
    adb("pull", f"{PHONE_DIR}/bin/tool", str(tmp_path / "back"))
    assert (tmp_path / "back").read_bytes() == tool.read_bytes() and os.access(tmp_path / "back", os.X_OK)
    missing = adb("pull", f"{PHONE_DIR}/nothing", str(tmp_path / "x"), check=False)
    assert missing.returncode == 1 and "No such file" in missing.stderr


def test_shell_rewrites_device_paths_and_returns_the_status(phone: Path) -> None:
    adb("shell", "mkdir", "-p", PHONE_DIR, "&&", "echo", "hi", ">", f"{PHONE_DIR}/f")
    assert (phone / "data/local/tmp/mobizo/f").read_text() == "hi\n"
    assert adb("shell", f"cat {PHONE_DIR}/f; exit 3", check=False).returncode == 3


def test_shell_streams_lines_as_they_are_printed(phone: Path) -> None:
    proc = subprocess.Popen(["adb", "shell", "echo first; sleep 5; echo second"], stdout=subprocess.PIPE, text=True)
    started = time.monotonic()
    assert proc.stdout.readline() == "first\n"
    assert time.monotonic() - started < 4  # it arrived before the command ended
    proc.terminate()
    proc.wait(timeout=10)


def test_killing_adb_hangs_up_the_phone_command(phone: Path, tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    proc = subprocess.Popen(["adb", "shell", f"echo $$ > {pid_file}; exec sleep 60"])
    pid = wait_for_pid(pid_file)
    proc.terminate()
    proc.wait(timeout=10)
    assert wait_until(lambda: exited(pid))


def test_a_killed_agent_takes_the_phone_command_with_it(phone: Path, tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    agent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, time; subprocess.Popen(['adb', 'shell', 'echo $$ > {pid_file}; "
            "exec sleep 60']); time.sleep(60)",
        ]
    )
    pid = wait_for_pid(pid_file)
    agent.kill()  # SIGKILL: no chance to clean up, as in a crash
    agent.wait(timeout=10)
    assert wait_until(lambda: exited(pid))


def wait_for_pid(pid_file: Path) -> int:
    assert wait_until(lambda: pid_file.exists() and pid_file.read_text().strip() != "")
    return int(pid_file.read_text())


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_missing_device_root_is_an_adb_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOBIZO_FAKE_DEVICE_ROOT", raising=False)
    monkeypatch.setenv("PATH", f"{ADB_STANDIN_DIR}{os.pathsep}{os.environ['PATH']}")
    done = adb("devices", check=False)
    assert done.returncode == 1 and "no devices" in done.stderr


@pytest.mark.slow  # uses the session's program export
def test_runner_trains_on_the_fake_phone(
    phone: Path, runner_binary: Path, tiny_program: Program, make_batches: Callable[..., Path], tmp_path: Path
) -> None:
    _train_on_phone(runner_binary, tiny_program, make_batches(4), tmp_path)


@pytest.mark.slow  # exports the session's 8da4w program
def test_runner_trains_an_8da4w_program_on_the_fake_phone(
    phone: Path, runner_binary: Path, tiny_program_8da4w: Program, make_batches: Callable[..., Path], tmp_path: Path
) -> None:
    """The runner's XNNPACK runs the int8 x int4 kernels: the same bits as the Python runtime."""
    _train_on_phone(runner_binary, tiny_program_8da4w, make_batches(4), tmp_path)


def _train_on_phone(runner_binary: Path, tiny_program: Program, batches: Path, tmp_path: Path) -> None:
    for local in (runner_binary, *tiny_program.files, batches):
        adb("push", str(local), f"{PHONE_DIR}/")
    program = (f"{PHONE_DIR}/{tiny_program.pte.name}", f"{PHONE_DIR}/{tiny_program.ptd.name}")
    binary, out_b = f"{PHONE_DIR}/{runner_binary.name}", f"{PHONE_DIR}/out.f32"
    args = runner_args(binary, program, f"{PHONE_DIR}/{batches.name}", out_b)
    status, lines, stderr = run_runner(["adb", "shell", *args])
    assert status == 0, stderr
    adb("pull", f"{PHONE_DIR}/out.f32", str(tmp_path / "out.f32"))
    reference, final_b = python_reference(tiny_program, batches)
    assert [as_f32(line["losses"]).tobytes() for line in lines] == [losses.tobytes() for losses, _ in reference]
    assert (tmp_path / "out.f32").read_bytes() == final_b.tobytes()


def test_the_emulator_runs_the_phones_aarch64_binaries_and_nothing_else(
    phone: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With MOBIZO_FAKE_DEVICE_EMULATOR set, a line that starts an aarch64 ELF file on the phone runs through it
    (as qemu-aarch64 runs the cross-built runner); host tools, scripts and other machines' ELF files do not."""
    emulator = tmp_path / "emulator"
    emulator.write_text('#!/bin/sh\necho "emulated: $*"\n')
    emulator.chmod(0o755)
    monkeypatch.setenv("MOBIZO_FAKE_DEVICE_EMULATOR", f"{emulator} -cpu cortex-a76")
    header = bytearray(64)
    header[:4] = b"\x7fELF"
    for name, machine in (("arm", 183), ("x86", 62)):
        binary = tmp_path / name
        binary.write_bytes(bytes(header[:18]) + machine.to_bytes(2, "little") + bytes(header[20:]))
        binary.chmod(0o755)
        adb("push", str(binary), f"{PHONE_DIR}/bin/")
    arm = adb("shell", f"{PHONE_DIR}/bin/arm", "--steps", "3").stdout
    assert arm == f"emulated: -cpu cortex-a76 {phone}{PHONE_DIR}/bin/arm --steps 3\n"
    assert "emulated" not in adb("shell", f"{PHONE_DIR}/bin/x86", check=False).stdout + adb("shell", "echo hi").stdout
    assert adb("shell", "echo hi").stdout == "hi\n"
