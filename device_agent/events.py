"""What the agent tells whoever watches it: a progress bar in a terminal, structured log lines otherwise.

Not a terminal (a service, a test, a log collector): one JSON object per line on stderr, ``{"ts", "event", ...}``;
training progress at most once per ``every_s`` seconds and at the last step. A terminal: a tqdm bar per job, and
the other events as short text lines above it.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any, TextIO


class Reporter:
    def __init__(self, stream: TextIO | None = None, tty: bool | None = None, every_s: float = 5.0) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.every_s = every_s
        self._bar: Any = None
        self._total = 0
        self._last_line = float("-inf")
        self._lock = threading.Lock()  # the heartbeat thread reports too: one whole line at a time

    def event(self, name: str, **fields: Any) -> None:
        if self.tty:
            text = " ".join(f"{k}={v}" for k, v in fields.items())
            line = f"{name}: {text}" if text else name
            if self._bar is not None:
                self._bar.write(line, file=self.stream)
            else:
                print(line, file=self.stream, flush=True)
            return
        record = {"ts": round(time.time(), 3), "event": name, **fields}
        line = json.dumps(record, default=str) + "\n"
        with self._lock:  # print() writes the text and its newline apart: two threads' lines could run together
            self.stream.write(line)
            self.stream.flush()

    def start_training(self, job_id: int, total: int, start: int) -> None:
        self._total = total
        if self.tty:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=start, desc=f"job {job_id}", unit="step", file=self.stream)
        self.event("training", job_id=job_id, steps=total, start=start)

    def step(self, job_id: int, step: int, loss: float, steps_per_s: float | None) -> None:
        """``step``: steps done so far."""
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            return
        now = time.monotonic()
        if now - self._last_line >= self.every_s or step == self._total:
            self._last_line = now
            self.event("progress", job_id=job_id, step=step, loss=round(loss, 6), steps_per_s=steps_per_s)

    def end_training(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
