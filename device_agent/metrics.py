"""``metrics.json`` of a run on the device (``mobizo agent run`` and ``mobizo run-program``): the keys
the contracts promise (docs/contracts.md), from the program's manifest, the training log and the measured step times."""

from __future__ import annotations

import statistics
from typing import Any

from shared.manifest import ProgramManifest
from shared.memory import peak_rss_mb
from shared.train_log import step_losses


def training_metrics(
    manifest: ProgramManifest, log: list[dict], step_seconds: list[float], run: dict[str, Any]
) -> dict[str, Any]:
    """The contracts' keys (docs/contracts.md) from the program, the log and the measured steps; ``run`` adds the rest
    (``seed``, ``lr``, ``eps``, ``backend``, ``eval``, ...). Holds no data and no file paths of the device."""
    config = manifest.config
    metrics = {
        "method": "mobizo",
        "q": config.q,
        "batch_size": config.batch_size,
        "examples_per_query": config.examples_per_query,
        "steps": len(log),
        "losses": step_losses(log),  # a private log has none: they stay on the device
        "step_time_s": statistics.median(step_seconds) if step_seconds else None,
        "train_time_s": sum(step_seconds),
        "peak_rss_mb": peak_rss_mb(),
        "eval": [],
        "seq_len": config.seq_len,
        "answer_len": config.answer_len,
        "rank": config.rank,
        "alpha": config.alpha,
        "targets": list(config.targets),
        "a_seed": config.a_seed,
        "optimizer": config.optimizer,
        "program_sha256": manifest.pte.sha256,
    }
    return metrics | run
