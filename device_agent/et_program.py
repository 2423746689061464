"""A mobizo training program loaded in the ExecuTorch Python runtime, as a Linux device runs it.

The same ``.pte`` + ``.ptd`` the native runner loads; the same kernels too (the pybindings and the runner link
the same ``libexecutorch*.so``), so both produce bit-identical losses and B.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from device_agent.batches import StepBatch, fit_width
from device_agent.et_runtime import runtime
from device_agent.native_log import runtime_log_filtered
from shared.manifest import PROGRAM_METHODS


class ProgramSession:
    """The program's methods, loaded once, around one B buffer shared by all of them.

    ``evaluate=False`` leaves the ``evaluate`` method unloaded, for a session that only trains (the executorch
    backend; the agent evaluates afterwards in a session of its own): each loaded method holds its own planned
    memory and, under XNNPACK, its own packed copy of every base weight. An idle ``evaluate`` made a SmolLM2 step's
    peak memory 1.55x that of an inference forward of the same rows; without it, 1.03x (float32; 8da4w: 1.32x ->
    1.16x; docs/benchmarks/program.md).

    ``widths``: the manifest's ``inputs.widths``, the columns the program takes; each batch then runs at its
    longest row (``batches.fit_width``). None: at the width it is given (a program of one width).
    """

    def __init__(
        self, pte: Path, ptd: Path | None, *, evaluate: bool = True, widths: tuple[int, int] | None = None
    ) -> None:
        self.widths = widths
        with runtime_log_filtered():
            program = runtime().load_program(Path(pte), data_path=ptd)
            missing = set(PROGRAM_METHODS) - program.method_names
            if missing:
                raise ValueError(f"{pte}: not a mobizo training program (missing {sorted(missing)})")
            # Every method the session uses is loaded before any runs: loading a method re-initialises the shared
            # B buffer, so a method loaded after training began would silently reset B.
            names = sorted(name for name in program.method_names if evaluate or name != "evaluate")
            self._methods = {name: program.load_method(name) for name in names}
        self._program = program

    def get_b(self) -> np.ndarray:
        return self._methods["get_lora_b"].execute([])[0].numpy().copy()

    def set_b(self, b: np.ndarray) -> None:
        """Start from ``b``; the optimizer's state, if it keeps one, from zeros."""
        import torch

        self._methods["set_lora_b"].execute([torch.from_numpy(np.asarray(b, dtype=np.float32).copy())])

    def get_state(self) -> np.ndarray | None:
        """The optimizer's state (``shared.zo_optim.flat_state``); None for a program without one (sgd)."""
        if "get_opt_state" not in self._methods:
            return None
        return self._methods["get_opt_state"].execute([])[0].numpy().copy()

    def set_state(self, state: np.ndarray) -> None:
        """The optimizer's state, after ``set_b`` (a resumed run's)."""
        import torch

        self._methods["set_opt_state"].execute([torch.from_numpy(np.asarray(state, dtype=np.float32).copy())])

    def step(
        self, batch: StepBatch, lr: float, eps: float, private: tuple[float, np.ndarray] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Run one ZO-SGD step (updates B inside the program); returns (losses [2q], g [q]) as float32.

        ``lr`` and ``eps`` enter the program as float32; pass float32 values (``float(np.float32(x))``) so this and
        the native runner, which parses its arguments with ``strtof``, use the very same numbers. ``private``: a
        private program's clip and the noise of its g's (``shared.privacy``).
        """
        import torch

        ids, mask = fit_width(batch.input_ids, batch.attention_mask, self.widths)
        inputs = [
            torch.from_numpy(np.ascontiguousarray(ids)),
            torch.from_numpy(np.ascontiguousarray(mask)),
            torch.from_numpy(batch.targets),
            torch.tensor([batch.seed], dtype=torch.int64),
            torch.tensor([lr], dtype=torch.float32),
            torch.tensor([eps], dtype=torch.float32),
        ]
        if private is not None:
            clip, noise = private
            inputs += [torch.tensor([clip], dtype=torch.float32), torch.from_numpy(np.asarray(noise, np.float32))]
        losses, g = self._methods["forward"].execute(inputs)
        return losses.numpy().copy(), g.numpy().copy()

    def evaluate(self, input_ids: np.ndarray, attention_mask: np.ndarray, targets: np.ndarray) -> np.ndarray:
        """Per-row loss (mean cross-entropy over each row's answer tokens) with the master B, no perturbation.

        Rows fill the program's shape (q*E rows, answer_len target columns, seq_len columns or, with ``widths``,
        as many as the longest row needs).
        """
        import torch

        if "evaluate" not in self._methods:
            raise RuntimeError("this session was opened for training only (evaluate=False)")
        arrays = (*fit_width(input_ids, attention_mask, self.widths), targets)
        inputs = [torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)) for a in arrays]
        return self._methods["evaluate"].execute(inputs)[0].numpy().copy()

    def evaluate_points(self, points, chunks) -> list[np.ndarray]:
        """``device_agent.evaluation.Evaluator``: each B of ``points`` set in turn (the last stays set; an optimizer
        state restarts from zeros) and every chunk of rows evaluated under it, stacked per B."""
        out = []
        for b in points:
            self.set_b(b)
            out.append(np.stack([self.evaluate(*chunk) for chunk in chunks]))
        return out
