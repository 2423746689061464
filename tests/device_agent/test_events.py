"""Progress for machines: one JSON object per line off a terminal, progress throttled."""

from __future__ import annotations

import io
import json

from device_agent.events import Reporter


def test_reporter_writes_json_lines_off_a_terminal_and_throttles_progress() -> None:
    out = io.StringIO()
    reporter = Reporter(out, tty=False, every_s=3600)
    reporter.start_training(5, total=3, start=0)
    for step in (1, 2, 3):
        reporter.step(5, step, 1.5, 10.0)
    reporter.event("uploaded", job_id=5, adapter_id=1)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(r["event"], r.get("step")) for r in lines] == [
        ("training", None),
        ("progress", 1),
        ("progress", 3),
        ("uploaded", None),
    ]  # the first step, then nothing until the last
    assert all("ts" in r for r in lines)
