"""Where the native runner's builds are (``device_agent/runner/build*.sh``), for the commands that push or run it."""

from __future__ import annotations

import platform
from pathlib import Path

from shared.cpuinfo import machine_arch

RUNNER_BUILD = Path(__file__).resolve().parent / "runner" / "build"


def bundle_dir(arch: str) -> Path:
    """The self-contained bundle ``build.sh --bundle`` makes for ``arch`` (aarch64, x86_64)."""
    return RUNNER_BUILD / f"{arch}-bundle"


def runner_default(backend: str = "native") -> Path:
    """The runner a backend pushes unless told: for adb, the phone's (the Android build, else the aarch64 bundle)
    when built, else the one built for this machine (the adb stand-in's phone runs it); for native, the one built
    for this machine, else a bundle for its architecture (one cross-built elsewhere and copied here)."""
    host = RUNNER_BUILD / "mobizo_runner"
    if backend == "adb":
        candidates = [RUNNER_BUILD / "android-arm64-v8a" / "mobizo_runner", bundle_dir("aarch64")]
    else:
        candidates = [host, bundle_dir(machine_arch(platform.machine()))]
    return next((path for path in candidates if path.exists()), host)
