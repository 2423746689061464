"""A compile worker's build that waits for a gate file (named by ``MOBIZO_TEST_GATE``) and then fails: a job that
stays ``compiling`` for as long as a test needs, in a real worker process of ``server.pool``."""

from __future__ import annotations

import os
import time
from pathlib import Path


def wait_then_fail(model_dir: str, model_sha256: str, spec: dict, programs: str, blobs: str) -> dict:
    gate = Path(os.environ["MOBIZO_TEST_GATE"])
    deadline = time.monotonic() + 120
    while not gate.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    raise RuntimeError("gated build: the test let it go")
