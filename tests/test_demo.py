"""The README's main command, ``bash scripts/demo.sh``, run as a user runs it (shortened): it walks the server
README's commands (users create, models register, enroll-code, agent enroll, jobs submit/list/show/cancel, agent
run, adapters list/download, eval), prints the accuracy line, keeps the runtime's log noise out, and exits 0.

It runs in a copy of the repository's tracked files (``git ls-files``) in a fresh folder, with its own code first on
``PYTHONPATH`` and only the checkout's ``.venv`` linked in: what a clone holds is enough, with nothing beside it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def clone_alone(dest: Path) -> Path:
    """The checkout's tracked files (as they are in the working tree) copied to ``dest``, with ``.venv`` linked to
    the checkout's → ``dest``. Skips where this is no git checkout. Fails, installing nothing, where ``.venv`` is
    older than ``pyproject.toml`` or ``scripts/setup.sh`` (the stamp ``scripts/setup.sh`` writes): the copy's
    ``setup.sh`` would then install the copy, editable, into the checkout's environment."""
    import hashlib
    import shutil

    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=False)
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.decode(errors='replace').strip()}")
    want = hashlib.sha256((REPO / "pyproject.toml").read_bytes() + (REPO / "scripts" / "setup.sh").read_bytes())
    stamp = REPO / ".venv" / ".mobizo-setup"
    if not stamp.is_file() or stamp.read_text().strip() != want.hexdigest():
        pytest.fail(".venv is older than pyproject.toml or scripts/setup.sh: run `bash scripts/setup.sh` first")
    for name in listed.stdout.decode().split("\0"):
        source = REPO / name
        if name and source.is_file():  # a tracked file deleted in the working tree is not copied
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    (dest / ".venv").symlink_to((REPO / ".venv").resolve())
    return dest


@pytest.mark.slow  # one export of the demo's program and a short training job
def test_demo_walks_the_readme_and_exits_zero(tmp_path: Path) -> None:
    repo = clone_alone(tmp_path / "alone" / "repo")  # nothing beside it
    env = {k: v for k, v in os.environ.items() if k != "MOBIZO_TASK_DATA_DIR"} | {
        "MOBIZO_DEMO_DIR": str(tmp_path / "demo"),
        "MOBIZO_DEMO_MODEL": "tiny",  # the quick variant: the path, not the model
        "MOBIZO_DEMO_STEPS": "3",
        "MOBIZO_DEMO_EVAL_LIMIT": "24",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(repo),  # the copy's code, not the checkout's (editable install)
    }
    done = subprocess.run(
        ["bash", "scripts/demo.sh"], cwd=repo, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    found = re.search(
        r"accuracy \(24 examples\): base model (0\.\d{3}), with the on-device adapter (0\.\d{3}) "
        r"\(([+-]\d+\.\d) points over the base model zero-shot\)",
        output,
    )
    assert found, output[-4000:]
    base, tuned, gain = map(float, found.groups())
    assert abs(gain - 100 * (tuned - base)) <= 0.16  # the gain of the two figures (each printed rounded)
    assert "cancelled" in done.stdout  # the second job, cancelled by the user
    assert re.search(r"held-out data \(100 examples, never uploaded\): accuracy [01]\.\d{3} -> [01]\.\d{3}", output)
    assert "cpuinfo_utils" not in output  # the runtime's CPU-probe lines (not pip's py-cpuinfo)
    adapter = tmp_path / "demo" / "adapter"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
