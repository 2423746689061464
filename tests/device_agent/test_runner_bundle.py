"""The runner's self-contained bundle (``device_agent/runner/build.sh --bundle``), built for this machine: the same
folder the aarch64 build makes for a phone or a board (``test_aarch64.py`` runs that one under qemu), run here for
real: its launcher, from anywhere, starts the runner through the bundle's own loader on the bundle's libraries."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


def test_the_bundle_needs_nothing_from_this_machines_libraries(runner_bundle: Path, tmp_path: Path) -> None:
    bundle = shutil.copytree(runner_bundle, tmp_path / "a folder" / "bundle")  # a space in the path
    (loader,) = bundle.glob("ld-linux*")
    listed = subprocess.run(
        [str(loader), "--library-path", str(bundle), "--list", str(bundle / "mobizo_runner.bin")],
        capture_output=True,
        text=True,
        check=False,
    )
    resolved = [line.split(" => ")[1].split(" (")[0] for line in listed.stdout.splitlines() if " => " in line]
    assert listed.returncode == 0 and len(resolved) >= 10, listed.stdout + listed.stderr
    assert {Path(path).parent for path in resolved} == {bundle}  # libexecutorch*, libstdc++, libc, the loader


def test_the_launcher_starts_the_runner_from_anywhere_under_a_posix_shell(runner_bundle: Path, tmp_path: Path) -> None:
    """The launcher is POSIX sh (a phone's is mksh): run as a program, and by ``sh`` (dash here), from another
    folder by a relative path, it starts the runner, which answers its usage error (exit 2)."""
    bundle = shutil.copytree(runner_bundle, tmp_path / "a folder" / "bundle")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for argv in (["../a folder/bundle/mobizo_runner"], ["sh", "../a folder/bundle/mobizo_runner"]):
        done = subprocess.run(argv, cwd=elsewhere, capture_output=True, text=True, check=False)
        assert done.returncode == 2 and "mobizo_runner: usage error: --batches is required" in done.stderr, done.stderr
    assert subprocess.run(["sh", "-n", str(bundle / "mobizo_runner")], check=False).returncode == 0
