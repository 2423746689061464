"""Resumable training runs: the state a killed ``mobizo train --checkpoint-every K`` continues from.

Step k trains on ``batch_indices(n, batch_size, seed, k)`` with seed ``step_seed(seed, k)``, both pure functions of
(run seed, k), so the master B after k steps plus what the run has recorded so far (per-step losses and times, the
training log, the evaluations) is everything a run needs to go on exactly as if it had never stopped. The same
holds for a *longer* run of the same configuration: a checkpoint of a 200-step run is a valid start for a 2,000-step
run (the accuracy benchmark continues its best learning-rate pilot this way), which is why ``steps`` is not part of
the fingerprint that a checkpoint must match.

A checkpoint also keeps the B of the best evaluation so far (highest accuracy, earliest on ties; lowest loss for
``lm`` tasks), so the adapter at the best held-out step can be tested without storing every B. The folder is
written with ``atomic_dir``: a kill during the write leaves the previous checkpoint whole.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from shared.errors import MobizoError
from shared.files import atomic_dir

CHECKPOINT_DIR, STATE_FILE, TENSORS_FILE = "checkpoint", "state.json", "b.safetensors"
UNFINGERPRINTED = ("steps", "out", "device", "checkpoint_every")  # may differ between a run and its continuation


@dataclass
class Checkpoint:
    """A run after ``step`` steps: master B, what it recorded, and the best evaluation's B."""

    step: int
    b: torch.Tensor
    history: dict[str, list]
    fingerprint: dict[str, Any]
    best: dict[str, Any] | None = None  # the best evaluation entry ({step, accuracy, loss})
    best_b: torch.Tensor | None = field(default=None, repr=False)
    opt_state: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)  # shared.zo_optim's

    def note_eval(self, entry: dict[str, Any], b: torch.Tensor) -> None:
        """Keep ``b`` if ``entry`` beats the best evaluation so far."""
        if self.best is None or _better(entry, self.best):
            self.best, self.best_b = dict(entry), b.detach().clone()


def _better(entry: dict[str, Any], best: dict[str, Any]) -> bool:
    if entry["accuracy"] is not None and best["accuracy"] is not None:
        return entry["accuracy"] > best["accuracy"]
    return entry["loss"] < best["loss"]


def fingerprint(config: dict[str, Any]) -> dict[str, Any]:
    """The configuration a checkpoint belongs to, as JSON values (paths as text, tuples as lists)."""
    return json.loads(json.dumps({k: v for k, v in config.items() if k not in UNFINGERPRINTED}, default=str))


def save_checkpoint(out: Path, checkpoint: Checkpoint) -> Path:
    """Write ``OUT/checkpoint/`` atomically (replacing the previous one)."""
    target = Path(out) / CHECKPOINT_DIR
    with atomic_dir(target) as tmp:
        tensors = {"b": checkpoint.b.detach().cpu().contiguous()}
        if checkpoint.best_b is not None:
            tensors["best_b"] = checkpoint.best_b.cpu().contiguous()
        tensors |= {f"opt.{name}": t.detach().cpu().contiguous() for name, t in checkpoint.opt_state.items()}
        save_file(tensors, str(tmp / TENSORS_FILE))
        state = {
            "step": checkpoint.step,
            "fingerprint": checkpoint.fingerprint,
            "best": checkpoint.best,
            "history": checkpoint.history,
        }
        (tmp / STATE_FILE).write_text(json.dumps(state))
    return target


def load_checkpoint(out: Path) -> Checkpoint | None:
    """The checkpoint in ``OUT/checkpoint/``, or None if there is none."""
    folder = Path(out) / CHECKPOINT_DIR
    if not (folder / STATE_FILE).is_file():
        return None
    try:
        state = json.loads((folder / STATE_FILE).read_text())
        tensors = load_file(str(folder / TENSORS_FILE))
    except (OSError, ValueError) as exc:
        raise MobizoError(f"cannot read the checkpoint in {folder}: {exc}") from exc
    return Checkpoint(
        step=int(state["step"]),
        b=tensors["b"],
        history=state["history"],
        fingerprint=state["fingerprint"],
        best=state["best"],
        best_b=tensors.get("best_b"),
        opt_state={name[4:]: t for name, t in tensors.items() if name.startswith("opt.")},
    )
