"""Where a job's steps run, behind one interface: ``executorch`` (this process, the ExecuTorch runtime), ``torch``
(this process, the same step module in eager PyTorch, CUDA when present), ``adb`` (an Android phone running the
native runner) and ``native`` (the native runner on this machine); the last two are one runner driver on two
transports (``device_agent.backends.runner``, ``device_agent.backends.transports``).

Every backend runs steps ``[start, N)`` of a pre-tokenized batches file (``device_agent.batches``) from a given B,
reports each step as it finishes, checkpoints every K steps, and on a stop request finishes the current step,
checkpoints and returns. Which step runs and from which B is decided by the caller (``device_agent.trainlog``), so
resuming is the same for all of them. Each names its ``host``, where the steps run: the memory and CPU the device
reports and the training policy's readings come from there. ``device_agent.backends.make.make_backend`` picks one
by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from device_agent.backends.transports import Host
from shared.manifest import ProgramManifest

if TYPE_CHECKING:
    from device_agent.evaluation import Evaluator


@dataclass(frozen=True)
class StepRecord:
    """One finished step as the program reported it."""

    step: int
    seed: int
    lr: float  # the float32 lr the step ran at: its batch record's (device_agent.batches)
    losses: np.ndarray  # float32 [2q] (a private step's stay on the device: not logged)
    g: np.ndarray  # float32 [q]
    seconds: float  # wall time of the step's forward call on the device


@dataclass(frozen=True)
class TrainRun:
    """Everything a backend needs to run one job's steps."""

    key: str  # identity of the run in checkpoints: a checkpoint of another key is never resumed
    program: Path
    weights: Path
    manifest: ProgramManifest
    batches: Path  # every step's data and lr (the job's schedule)
    eps: float  # a float32 value, see device_agent.et_program
    init_b: np.ndarray  # B before step 0 (zeros or the job's starting adapter): a .pte carries no B of its own
    checkpoint: Path
    checkpoint_every: int  # 0: only when stopped
    # A private job's step k -> (clip, the noise of its q g's) from the device's private seed (device_agent.job);
    # None: not private
    private: Callable[[int], tuple[float, np.ndarray]] | None = None


@dataclass(frozen=True)
class Outcome:
    next_step: int
    b: np.ndarray | None  # the final B when every step ran; None when stopped early


OnStep = Callable[[StepRecord], None]
ShouldStop = Callable[[], bool]


class Backend(Protocol):
    name: str
    host: Host  # where the steps run: this machine, or the phone for adb (its memory, CPU and policy readings)

    def recover(self, run: TrainRun) -> None:
        """Bring the newest checkpoint of ``run`` to ``run.checkpoint`` on this machine, if it lives elsewhere."""

    def train(
        self,
        run: TrainRun,
        start: int,
        start_b: np.ndarray | None,
        on_step: OnStep,
        should_stop: ShouldStop,
        start_state: np.ndarray | None = None,
    ) -> Outcome:
        """Run steps ``[start, N)`` from ``start_b`` (None: ``run.init_b``), set before the first step, and the
        optimizer's ``start_state`` (None: zeros; a resumed run's, ``device_agent.trainlog.resume_point``)."""

    def forget(self, run: TrainRun) -> None:
        """Delete what the run left where the steps ran (its batches hold the user's tokens)."""

    def evaluator(self, run: TrainRun) -> Evaluator:
        """Where the run's held-out points are measured: its program's ``evaluate`` method on the runtime that
        trained it (``device_agent.evaluation``): the ExecuTorch runtime in this process for ``executorch`` and
        ``torch`` (``device_agent.et_program.ProgramSession``), the runner's ``evaluate`` mode where the runner runs
        for ``native`` and ``adb`` (``device_agent.runner_evaluator.RunnerEvaluator``)."""
