"""The device's install (``mobizo[device]``): no torch, executorch, transformers or server stack, and the agent's
modules and commands work without them. On this machine the heavy packages are installed, so a device install is
simulated by a finder that refuses them (``tests/utils/device_install``); the real one is an emulated arm64 device
(``tests/device_agent/test_arm64_device.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mobizo.cli import ROLE_OF

REPO = Path(__file__).resolve().parents[2]
DEVICE_INSTALL = REPO / "tests" / "utils" / "device_install"
HEAVY = {"torch", "executorch", "transformers", "fastapi", "sqlalchemy", "celery"}

# Every module the agent imports on a device, whatever the backend it trains with (the runner backends: native,
# adb). The in-process backends (executorch, torch) and the host's commands need the export extra.
DEVICE_MODULES = (
    "mobizo.cli",
    "device_agent.api",
    "device_agent.batches",
    "device_agent.checkpoint",
    "device_agent.commands.agent",
    "device_agent.config",
    "device_agent.daemon",
    "device_agent.download",
    "device_agent.eligibility",
    "device_agent.evaluation",
    "device_agent.events",
    "device_agent.heartbeat",
    "device_agent.job",
    "device_agent.local_data",
    "device_agent.metrics",
    "device_agent.native_log",
    "device_agent.runner_evaluator",
    "device_agent.runner_path",
    "device_agent.trainlog",
    "device_agent.backends",
    "device_agent.backends.make",
    "device_agent.backends.runner",
    "device_agent.backends.transports",
    "shared.data",
    "shared.noise",
    "shared.privacy",
    "shared.replay",
    "shared.tokenizer_file",
)


def device_env(**extra: str) -> dict[str, str]:
    """The environment of a process that sees a device install: the heavy packages refused."""
    return {**os.environ, "PYTHONPATH": f"{DEVICE_INSTALL}{os.pathsep}{REPO}", **extra}


def on_device(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], env=device_env(), cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def test_the_finder_refuses_what_the_roles_name() -> None:
    """The simulation refuses exactly the packages of the export and server extras (the CLI's table)."""
    code = "import sitecustomize as s; print(sorted(s._BLOCKED))"
    blocked = json.loads(on_device("-c", code.replace("print(", "import json; print(json.dumps(")[:-1] + "))").stdout)
    assert set(blocked) == {name for name, role in ROLE_OF.items() if role != "device"}
    assert HEAVY <= set(blocked)


def test_the_device_extra_resolves_without_the_heavy_packages(tmp_path: Path) -> None:
    """What ``pip install 'mobizo[device]'`` would install, as pip resolves it against the package index."""
    report = tmp_path / "report.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--dry-run",
            "--ignore-installed",
            "--report",
            str(report),
            f"{REPO}[device]",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    names = {item["metadata"]["name"].lower().replace("_", "-") for item in json.loads(report.read_text())["install"]}
    assert {"mobizo", "numpy", "httpx", "pydantic", "tokenizers"} <= names
    assert not names & {"torch", "executorch", "transformers", "fastapi", "sqlalchemy", "celery", "peft", "uvicorn"}


def test_the_agents_modules_import_on_a_device_install() -> None:
    code = "import importlib, sys\nfor name in sys.argv[1:]: importlib.import_module(name)\n"
    code += f"print(sorted(m for m in {sorted(HEAVY)!r} if m in sys.modules))"
    done = on_device("-c", code, *DEVICE_MODULES)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("command", "role"),
    [
        (["server"], "server"),
        (["worker"], "server"),
        (["make-tiny-model", "--out", "unused"], "export"),
        (["export", "--help"], None),
        (["agent", "run", "--help"], None),
    ],
)
def test_a_command_of_another_role_names_its_extra(command: list[str], role: str | None) -> None:
    """On a device install every command's help works; running one that needs another role's packages is one
    line naming the extra to install, exit 2, never a traceback."""
    done = on_device("-m", "mobizo", *command)
    if role is None:
        assert done.returncode == 0, done.stderr
        assert "usage: mobizo" in done.stdout
        return
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith(f"pip install 'mobizo[{role}]'"), lines
