"""A job's program contract resolved once: from a spec (a job's, or ``mobizo export``'s options) and its model to
the ``ProgramConfig`` its device program is exported for.

What only the model tells is resolved here and nowhere else: the objective with its candidates' token ids and the
answer length (``shared.data.resolve_objective``), and a calibrated objective's prior (measured on the base model by
the caller's ``prior``). The server's compile (``server.compile.resolve_config``) and ``mobizo export`` both come
here, so a job's program and the program a user exports with the same options are one; ``mobizo train`` resolves
its objective with the same ``resolve_objective`` and maps its run through the same ``ProgramConfig.from_spec``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from shared.errors import UsageError
from shared.manifest import ProgramConfig
from shared.tasks import Task


def resolve_program(
    spec: Mapping[str, Any],
    task: Task,
    tokenizer: Any,
    chat: tuple[str, str] | None = None,
    prior: Callable[[], tuple[float, ...]] | None = None,
) -> ProgramConfig:
    """The program of ``spec`` (``ProgramConfig.from_spec``'s fields, with ``objective``, ``answer_len`` and
    ``calibrate`` as a job has them) for ``task`` already in its chat frame ``chat``. ``prior`` measures a
    calibrated job's prior; a spec asking for calibration without one is a ``UsageError`` naming ``calibrate``."""
    from shared.data import resolve_objective

    objective, candidates, answer_len = resolve_objective(
        task, tokenizer, spec.get("objective"), spec.get("answer_len")
    )
    if answer_len is None:
        raise UsageError("answer_len", "the task's answers come from the data: a program needs their length")
    measured: tuple[float, ...] = ()
    if spec.get("calibrate") and objective == "classification":
        if prior is None:
            raise UsageError("calibrate", "a calibrated program needs its prior measured on the base model")
        measured = tuple(prior())
    return ProgramConfig.from_spec(spec, answer_len, chat, objective, candidates, measured)
