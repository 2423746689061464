"""Backends that run the program in this process (``executorch``, ``torch``): the step loop and its checkpoints.

An engine is the program's methods around its master B (``device_agent.et_program.ProgramSession`` or
``device_agent.backends.torch_eager.TorchSession``); the loop is the same for both, and ``mobizo run-program`` uses
it too. A step's record is handed on (and so logged) before a checkpoint that includes it is written.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from device_agent.backends import OnStep, Outcome, ShouldStop, StepRecord, TrainRun
from device_agent.backends.transports import Host, ThisMachine
from device_agent.batches import BatchesFile, StepBatch
from device_agent.checkpoint import Checkpoint, save_checkpoint

if TYPE_CHECKING:
    from device_agent.et_program import ProgramSession


class Engine(Protocol):
    def get_b(self) -> np.ndarray: ...

    def set_b(self, b: np.ndarray) -> None: ...

    def set_state(self, state: np.ndarray) -> None: ...

    def step(
        self, batch: StepBatch, lr: float, eps: float, private: tuple[float, np.ndarray] | None = None
    ) -> tuple[np.ndarray, np.ndarray]: ...


def run_steps(
    engine: Engine,
    batches: Sequence[StepBatch],
    eps: float,
    start: int,
    on_step: OnStep,
    should_stop: ShouldStop,
    checkpoint: Callable[[int], None] | None = None,
    every: int = 0,
    private: Callable[[int], tuple[float, np.ndarray]] | None = None,
) -> int:
    """Run steps ``[start, len(batches))``, each at its record's lr; returns the next step (``len(batches)`` when
    all ran).

    ``checkpoint(next_step)`` is called every ``every`` steps and when a stop is requested (after the step);
    ``private(k)``: a private job's clip and noise for step k (``TrainRun.private``).
    """
    for k in range(start, len(batches)):
        batch = batches[k]
        began = time.perf_counter()
        losses, g = engine.step(batch, batch.lr, eps, None if private is None else private(k))
        on_step(StepRecord(k, batch.seed, batch.lr, losses, g, time.perf_counter() - began))
        done = k + 1
        stopping = done < len(batches) and should_stop()
        if checkpoint is not None and (stopping or (every and done % every == 0)):
            checkpoint(done)
        if stopping:
            return done
    return len(batches)


@dataclass
class LocalBackend:
    """The loop above around an engine opened per run."""

    name: str
    open_engine: Callable[[TrainRun], Engine]
    host: Host = field(default_factory=ThisMachine)

    def recover(self, run: TrainRun) -> None:
        """Nothing to fetch: this backend writes its checkpoints here."""

    def forget(self, run: TrainRun) -> None:
        """Nothing to delete: the run's files are the caller's."""

    def evaluator(self, run: TrainRun) -> ProgramSession:
        return session_evaluator(run)

    def train(
        self,
        run: TrainRun,
        start: int,
        start_b: np.ndarray | None,
        on_step: OnStep,
        should_stop: ShouldStop,
        start_state: np.ndarray | None = None,
    ) -> Outcome:
        engine = self.open_engine(run)
        engine.set_b(start_b if start_b is not None else run.init_b)  # the program has no B of its own
        if start_state is not None:  # a resumed run's optimizer state (setting B started it from zeros)
            engine.set_state(start_state)

        def checkpoint(next_step: int) -> None:
            save_checkpoint(run.checkpoint, Checkpoint(run.key, next_step, engine.get_b()))

        batches = BatchesFile(run.batches)
        every = run.checkpoint_every
        done = run_steps(engine, batches, run.eps, start, on_step, should_stop, checkpoint, every, run.private)
        return Outcome(done, engine.get_b() if done == len(batches) else None)


def session_evaluator(run: TrainRun) -> ProgramSession:
    """The run's program in the ExecuTorch runtime of this process, as the held-out evaluator of both local
    backends (the torch backend's eager module has no ``.pte`` kernels: the device's figures are the program's)."""
    from device_agent.et_program import ProgramSession

    return ProgramSession(run.program, run.weights, widths=run.manifest.inputs.widths)


def executorch_backend() -> LocalBackend:
    from device_agent.et_program import ProgramSession

    def open_engine(run: TrainRun) -> ProgramSession:
        return ProgramSession(run.program, run.weights, evaluate=False, widths=run.manifest.inputs.widths)

    return LocalBackend("executorch", open_engine)
