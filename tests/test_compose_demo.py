"""docker-compose.yml run: ``bash scripts/compose.sh demo`` takes one job through PostgreSQL, Redis, two API
processes, Celery workers and the containerized agent (compiled by a worker, trained by the agent, verified, its
adapter downloaded), a second job on another of three workers, and a restart that keeps jobs, adapters and their
files; the test reads the demo's own checks back from its output.

Building the images takes about 25 minutes on a 2-core VM (the Debian root, the wheels, the install), so the test
runs only where they are already built for this checkout's Dockerfiles, pyproject.toml and Debian root
(``scripts/compose.sh cached``), and skips, naming what is missing, where they are not or where no Docker engine
can start. The stack is its own compose project on free loopback ports, removed with its volumes at the end."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.server.live import free_port

REPO = Path(__file__).resolve().parents[1]
SCRIPT = ["bash", str(REPO / "scripts" / "compose.sh")]


@pytest.fixture
def stack(tmp_path: Path):
    """The environment of a compose project of the test's own, removed (with its volumes) afterwards."""
    gate = subprocess.run([*SCRIPT, "cached"], cwd=REPO, capture_output=True, text=True, check=False)
    if gate.returncode != 0:
        pytest.skip(f"compose: {(gate.stdout + gate.stderr).strip()}")
    env = os.environ | {
        "MOBIZO_COMPOSE_PROJECT": f"mobizo-test-{os.getpid()}",
        "MOBIZO_COMPOSE_API_PORT": str(free_port()),
        "MOBIZO_COMPOSE_DB_PORT": str(free_port()),
        "MOBIZO_COMPOSE_REDIS_PORT": str(free_port()),
        "MOBIZO_COMPOSE_DIR": str(tmp_path / "compose"),
        "MOBIZO_ADMIN_TOKEN": "compose-test-admin-token-" + "0" * 16,
    }
    yield env
    subprocess.run([*SCRIPT, "--profile", "agent", "down", "-v"], cwd=REPO, env=env, capture_output=True, check=False)


@pytest.mark.slow  # two exports and two short trainings in containers, a restart of the stack: minutes
def test_one_job_through_the_stack_scaled_and_restarted(stack: dict[str, str]) -> None:
    done = subprocess.run(
        [*SCRIPT, "demo"], cwd=REPO, env=stack, capture_output=True, text=True, timeout=1500, check=False
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert "job 1: succeeded" in output and "job 2: succeeded" in output, output[-3000:]
    first, second = re.search(r"compiled by (\S+) \(the first job's: (\S+)\)", output).group(2, 1)
    assert first != second and re.fullmatch(r".*[_-]worker[_-]\d+", second), output[-3000:]
    kept = re.search(r"adapter \S+: sha256 ([0-9a-f]{64}) before and after", output)
    assert kept, output[-3000:]
    steps = re.findall(r"^== \[\s*([\d.]+) s \|", output, flags=re.M)
    assert len(steps) == 12, output[-3000:]  # every step of the demo, its end included
