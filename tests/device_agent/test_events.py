"""Progress for machines: one JSON object per line off a terminal, progress throttled."""

from __future__ import annotations

import io
import json
import threading
import time

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


class SlowStream(io.StringIO):
    """Gives the other thread its turn inside every write, as a pipe that blocks would."""

    def write(self, text: str) -> int:
        time.sleep(0.0001)
        return super().write(text)


def test_lines_from_two_threads_never_run_together() -> None:
    """The heartbeat thread and the training loop report at once; each event must still be one whole line."""
    out = SlowStream()
    reporter = Reporter(out, tty=False)

    def report(name: str) -> None:
        for i in range(100):
            reporter.event(name, i=i)

    threads = [threading.Thread(target=report, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert sorted((r["event"], r["i"]) for r in lines) == [(n, i) for n in ("a", "b") for i in range(100)]
