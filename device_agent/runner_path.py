"""Where the native runner's builds are (``device_agent/runner/build*.sh``), for the commands that push or run it."""

from __future__ import annotations

from pathlib import Path

RUNNER_BUILD = Path(__file__).resolve().parent / "runner" / "build"


def runner_default() -> Path:
    """The runner built for a phone when there is one, else the one built for this machine (adb stand-in)."""
    android = RUNNER_BUILD / "android-arm64-v8a" / "mobizo_runner"
    return android if android.is_file() else RUNNER_BUILD / "mobizo_runner"
