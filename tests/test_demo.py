"""The README's main command, ``bash scripts/demo.sh``, run as a user runs it (shortened): it walks the server
README's commands (users create, models register, enroll-code, agent enroll, jobs submit/list/show/cancel, agent
run, adapters list/download, eval), prints the accuracy line, keeps the runtime's log noise out, and exits 0."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # one export of the demo's program and a short training job
def test_demo_walks_the_readme_and_exits_zero(tmp_path: Path) -> None:
    env = os.environ | {
        "MOBIZO_DEMO_DIR": str(tmp_path / "demo"),
        "MOBIZO_DEMO_STEPS": "3",
        "MOBIZO_DEMO_EVAL_LIMIT": "24",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    done = subprocess.run(
        ["bash", "scripts/demo.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert re.search(r"accuracy \(24 examples\): base model 0\.\d{3}, with the on-device adapter 0\.\d{3}", output)
    assert "cancelled" in done.stdout  # the second job, cancelled by the user
    assert re.search(r"held-out data \(100 examples, never uploaded\): accuracy [01]\.\d{3} -> [01]\.\d{3}", output)
    assert "cpuinfo_utils" not in output  # the runtime's CPU-probe lines (not pip's py-cpuinfo)
    adapter = tmp_path / "demo" / "adapter"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
