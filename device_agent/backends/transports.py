"""Where a device's steps run, and how files and commands get there.

A ``Host`` is what the server and the training policy see of the place the steps run: its free memory, its CPU and
the policy's readings. ``ThisMachine`` is the agent's own (the ``executorch`` and ``torch`` backends run there).

A ``Transport`` is a host the native runner runs on, reached through one small interface that the runner driver
(``device_agent.backends.runner``) uses for everything: run a shell command (waiting for it, or streaming its
output), push a file, push a content-addressed file or folder once, pull a file, ask whether a path exists.
Device paths are POSIX strings; commands are ``sh`` command lines.

- ``Phone``: an Android phone over ``adb`` (the ``adb`` backend). Readings come from ``dumpsys``, memory and CPU
  from its ``/proc``.
- ``LocalHost``: this machine, under a work folder (the ``native`` backend: a Jetson, a Raspberry Pi, any Linux
  box). Commands run with ``sh -c``; pushes are hard links where the file system allows (the files pushed once are
  written by renaming, never in place, so a link keeps what was pushed), else copies. A runner it starts dies with
  the agent's process (Linux's parent-death signal, as a phone's runner is hung up when adb's connection drops).
"""

from __future__ import annotations

import os
import platform
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import IO, Protocol

from device_agent.eligibility import Readings, parse_dumpsys, read_sysfs
from shared.cpuinfo import parse_cpuinfo, this_cpu
from shared.errors import MobizoError
from shared.files import make_dirs, publish_once
from shared.memory import free_memory_mb, meminfo_available_mb
from shared.processes import dies_with_this_process
from shared.schemas import CpuReport

PHONE_ROOT = "/data/local/tmp/mobizo"


class Host(Protocol):
    """Where a backend's steps run, as the server (memory, CPU) and the training policy (readings) see it."""

    def platform(self) -> str:
        """What the device reports as its platform at enrollment."""

    def free_memory_mb(self) -> int | None:
        """Memory available to a training run there, in MiB (None: unknown)."""

    def cpu(self) -> CpuReport | None:
        """Its CPU, as the device reports it to the server (None: unreadable)."""

    def readings(self, sysfs_root: Path) -> Readings:
        """The training policy's readings there (``sysfs_root``: where this machine's ``/sys`` is read)."""


class Transport(Host, Protocol):
    """A host the native runner runs on: shell commands and files under ``root``."""

    root: str  # the folder the runner's files live in there
    where: str  # for messages: "the phone", "this machine"

    def shell(self, command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``command`` there, wait, and return its status and output (``check``: MobizoError if it failed)."""

    def start(self, command: str, stdout: int | IO, stderr: int | IO) -> subprocess.Popen:
        """Start ``command`` there, its output (text) streaming as it prints it; killing the process stops it."""

    def exists(self, path: str) -> bool: ...

    def push(self, local: Path, remote: str) -> str:
        """Copy the file ``local`` to ``remote`` (replacing it) → ``remote``."""

    def push_once(self, local: Path, remote: str) -> str:
        """Put the file or folder ``local`` at ``remote`` unless something is there already (the name says what it
        holds: a content hash); it appears whole or not at all → ``remote``."""

    def pull(self, remote: str, local: Path) -> Path: ...


class ThisMachine:
    """The machine the agent runs on."""

    def platform(self) -> str:
        return platform.platform(terse=True)

    def free_memory_mb(self) -> int | None:
        return free_memory_mb()

    def cpu(self) -> CpuReport | None:
        arch, features = this_cpu()
        return CpuReport(arch=arch, features=features)

    def readings(self, sysfs_root: Path) -> Readings:
        return read_sysfs(sysfs_root)


class LocalHost(ThisMachine):
    """This machine as the runner's transport: its files under ``root``."""

    where = "this machine"

    def __init__(self, root: Path) -> None:
        self.root = str(make_dirs(Path(root)).resolve())  # created private: a job's batches hold the user's tokens

    def shell(self, command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=False)
        if check and done.returncode != 0:
            reason = (done.stderr or done.stdout).strip()
            raise MobizoError(f"{command.split()[0]} failed ({done.returncode}): {reason}")
        return done

    def start(self, command: str, stdout: int | IO, stderr: int | IO) -> subprocess.Popen:
        # exec: the runner itself is the child, so the parent-death signal reaches it
        argv, die = ["sh", "-c", f"exec {command}"], dies_with_this_process()
        return subprocess.Popen(argv, stdout=stdout, stderr=stderr, text=True, preexec_fn=die)

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)

    def push(self, local: Path, remote: str) -> str:
        Path(remote).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local, remote)
        return remote

    def push_once(self, local: Path, remote: str) -> str:
        target = Path(remote)
        if target.exists():
            return remote
        target.parent.mkdir(parents=True, exist_ok=True)
        if Path(local).is_dir():  # a bundle: linked file by file into a folder renamed into place
            publish_once(target, lambda tmp: shutil.copytree(local, tmp, copy_function=_link, dirs_exist_ok=True))
        else:
            part = target.with_name(f".{target.name}.{os.getpid()}.part")
            _link(local, part)
            os.replace(part, target)
        return remote

    def pull(self, remote: str, local: Path) -> Path:
        shutil.copyfile(remote, local)
        return Path(local)


def _link(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """A hard link of ``src`` at ``dst``; a copy (mode kept) where the file system refuses one."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


class Phone:
    """An Android phone over ``adb`` (``serial``, or the only one attached): files under ``root``."""

    where = "the phone"

    def __init__(self, serial: str | None = None, adb: str = "adb", root: str = PHONE_ROOT) -> None:
        self.prefix = [adb, *(["-s", serial] if serial else [])]
        self.root = root
        self._cpu: CpuReport | None = None

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

    def start(self, command: str, stdout: int | IO, stderr: int | IO) -> subprocess.Popen:
        try:
            return subprocess.Popen([*self.prefix, "shell", command], stdout=stdout, stderr=stderr, text=True)
        except FileNotFoundError:
            raise MobizoError(f"{self.prefix[0]}: not found; install Android platform-tools") from None

    def exists(self, path: str) -> bool:
        return self.shell(f"test -e {shlex.quote(path)}", check=False).returncode == 0

    def push(self, local: Path, remote: str) -> str:
        self.run("push", str(local), remote)
        return remote

    def push_once(self, local: Path, remote: str) -> str:
        if not self.exists(remote):
            part = shlex.quote(remote + ".part")
            self.shell(f"rm -rf {part}")  # an interrupted push's: adb would push a folder into it
            self.run("push", str(local), remote + ".part")
            self.shell(f"mv {part} {shlex.quote(remote)}")
        return remote

    def pull(self, remote: str, local: Path) -> Path:
        self.run("pull", remote, str(local))
        return Path(local)

    def platform(self) -> str:
        return "android (adb)"

    def free_memory_mb(self) -> int | None:
        done = self.shell("cat /proc/meminfo", check=False)
        return meminfo_available_mb(done.stdout) if done.returncode == 0 else None

    def cpu(self) -> CpuReport | None:
        """The phone's CPU, from its /proc/cpuinfo (an Arm kernel's lists ``Features``), read once (it does not
        change while this agent drives it); None if unreadable."""
        if self._cpu is None:
            done = self.shell("cat /proc/cpuinfo", check=False)
            if done.returncode != 0:
                return None
            arch, features = parse_cpuinfo(done.stdout)
            self._cpu = CpuReport(arch=arch, features=features)
        return self._cpu

    def readings(self, sysfs_root: Path) -> Readings:
        """``dumpsys battery``, ``thermalservice`` and ``power`` on the phone (this machine's sysfs is not the
        phone's)."""
        services = ("battery", "thermalservice", "power")
        return parse_dumpsys(*(self.shell(f"dumpsys {service}", check=False).stdout for service in services))
