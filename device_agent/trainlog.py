"""The training log as a device keeps it: one flushed line per step, cut back to the checkpoint on resume.

A run's state on disk is the log (``shared.train_log`` format) and the last checkpoint (``device_agent.checkpoint``).
In this process each step's line is flushed before any checkpoint that includes the step, so after a kill the
log holds at least the checkpoint's steps; resuming keeps exactly those lines and continues from the checkpoint,
so the finished log and B are those of an uninterrupted run. A line cut short by the kill is dropped.

The one exception is a phone (adb): its runner checkpoints by itself and outlives a killed agent by a step or
two, so its checkpoint can be ahead of the lines the agent logged. The log is what the server replays, so then
the run continues after the last logged step, from B rebuilt by replaying the log (``shared.replay``: the same
float32 arithmetic as the program's update, so bit for bit the runner's B).

An optimizer that keeps a state (``shared.zo_optim``: momentum, normalized) needs it back too: it is a function of
the logged g alone, so a resumed run's state is rebuilt by replaying the log's kept lines (a few vector operations
per step), for every backend alike; checkpoints hold B and the next step only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple, TextIO

import numpy as np

from device_agent.checkpoint import load_checkpoint
from shared.files import atomic_write_bytes, open_private
from shared.train_log import log_line


def read_complete(path: Path) -> list[dict]:
    """The log's records up to the first line that is not a whole record of the next step."""
    path = Path(path)
    if not path.exists():
        return []
    records: list[dict] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            break
        if not isinstance(record, dict) or record.get("step") != len(records):
            break
        records.append(record)
    return records


class Resume(NamedTuple):
    """Where a run continues: its first step, B before it and the optimizer's state (None: start over; no state)."""

    step: int
    b: np.ndarray | None
    state: np.ndarray | None = None


def resume_point(
    log_path: Path, checkpoint_path: Path, key: str, init_b: np.ndarray | None, optimizer: str = "sgd"
) -> Resume:
    """Where the run continues, with the log cut back to match; ``Resume(0, None)`` when starting over.

    A checkpoint of ``key`` that the log covers is resumed; one ahead of the log is replaced by the replay of the
    log from ``init_b`` (B before step 0; None when not known: start over). Without a checkpoint, start over. The
    state of an ``optimizer`` that keeps one is the replay's (from ``init_b``; not known: start over).
    """
    records = read_complete(log_path)
    ckpt = load_checkpoint(checkpoint_path, key)
    covered = ckpt is not None and ckpt.next_step <= len(records)
    from_log = not covered or optimizer != "sgd"  # B, or the optimizer's state, is the replay's: init_b needed
    start, b, state = 0, None, None
    if ckpt is not None and (init_b is not None or not from_log):
        start, b = (ckpt.next_step, ckpt.b) if covered else (len(records), None)
    if start > 0 and from_log:
        from shared.replay import replay_state
        from shared.zo_optim import flat_state

        replayed, kept = replay_state(np.asarray(init_b, np.float32), records[:start], optimizer)  # NumPy: no torch
        b = replayed if b is None else b
        state = flat_state(kept) if kept else None
    atomic_write_bytes(Path(log_path), "".join(map(log_line, records[:start])).encode())
    return Resume(start, b, state)


class LogWriter:
    """Appends records to the log, each line flushed at once (a checkpoint may follow right after)."""

    def __init__(self, path: Path) -> None:
        self._file: TextIO = open_private(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._file.write(log_line(record))
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> LogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
