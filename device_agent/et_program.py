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
from shared.manifest import PROGRAM_METHODS, ProgramManifest


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


class ProgramStep:
    """The program's step behind ``shared.train.MethodStep``'s interface (``b``, ``device``, ``step(batch, seed,
    lr) -> (losses, g)``), so that ``shared.train.train`` trains through the very program a device runs
    (``benchmarks/accuracy.py --runner program``; ``shared.train.StepFactory``). The loop builds its batches at the
    program's shape, as the agent's are (each runs at its longest row). Each step puts ``b`` into the program, runs
    ``forward`` and reads B back: a resumed run's ``b``, set from its checkpoint, is what the next step starts
    from. The optimizer's state goes the same way (``opt_state``, as ``MethodStep`` keeps it).
    """

    def __init__(self, pte: Path, ptd: Path, eps: float, manifest: ProgramManifest) -> None:
        import torch

        from shared.zo_optim import new_state

        self.q = manifest.config.q
        self.session = ProgramSession(pte, ptd, evaluate=False, widths=manifest.inputs.widths)
        if not (isinstance(eps, int | float) and np.isfinite(eps) and eps > 0):
            raise ValueError(f"eps must be a positive number, got {eps!r}")
        self.eps = float(np.float32(eps))
        self.device = torch.device("cpu")
        self.b = torch.zeros(manifest.lora_size, dtype=torch.float32)
        self.optimizer = manifest.config.optimizer
        self.opt_state = new_state(self.optimizer, manifest.lora_size)
        self.privatizer = None  # a private run's (``shared.train``), for a private program

    def __call__(self, batch, seed: int, lr: float):
        import torch

        from shared.zo_optim import flat_state, state_of

        ids, mask, targets = (t.cpu().numpy() for t in (batch.input_ids, batch.attention_mask, batch.targets))
        lr32 = float(np.float32(lr))
        self.session.set_b(self.b.numpy())
        if self.opt_state:
            self.session.set_state(flat_state(self.opt_state).numpy())
        private = None
        if self.privatizer is not None:
            private = (float(np.float32(self.privatizer.clip)), self.privatizer.noise(self.q))
        losses, g = self.session.step(StepBatch(seed, lr32, ids, mask, targets), lr32, self.eps, private)
        self.b = torch.from_numpy(self.session.get_b())
        if self.opt_state:
            self.opt_state = state_of(self.optimizer, torch.from_numpy(self.session.get_state()))
        return torch.from_numpy(losses), torch.from_numpy(g)


class FirstOrderStep:
    """The first-order peer's program (``shared.fo_program``) in ExecuTorch's training runtime, behind
    ``shared.train.MethodStep``'s interface as ``ProgramStep`` is: the runtime computes the loss and B's gradient
    (``forward_backward``), and the extension's SGD moves B in place, at the step's lr (SGD keeps no state, so an
    optimizer per step is the same update). ``__call__`` returns (loss [1], the gradient's norm [1]), as the eager
    ``fo-lora`` step does. B lives in the program (exported as zeros); a ``b`` set from outside (a resumed run's
    checkpoint) is written into the program's parameter, whose handle the runtime gives after a first call.
    ``seq_len``: the program's one width (``shared.fo_program``): each batch runs padded or cut to it."""

    def __init__(self, pte: Path, ptd: Path | None, size: int, seq_len: int) -> None:
        import torch
        from executorch.extension.pybindings.portable_lib import _load_for_executorch
        from executorch.extension.training import TrainingModule

        with runtime_log_filtered():
            self.module = TrainingModule(_load_for_executorch(str(pte), data_path=None if ptd is None else str(ptd)))
        self.device = torch.device("cpu")
        self.b = torch.zeros(size, dtype=torch.float32)
        self._in_program = self.b  # the program's B is this tensor's value (the same object: nobody replaced it)
        self.widths = (seq_len, seq_len)
        self.q = 1
        self.optimizer, self.opt_state, self.privatizer = "sgd", {}, None

    def forward_backward(self, ids, mask, targets) -> tuple:
        """(loss, {name: gradient}, {name: the program's own parameter}) at the program's B."""
        loss = self.module.forward_backward("forward", [ids, mask, targets])[0]
        return loss, self.module.named_gradients(), self.module.named_parameters()

    def __call__(self, batch, seed: int, lr: float):
        import torch
        from executorch.extension.training import get_sgd_optimizer

        del seed  # a first-order step draws no noise
        ids, mask = fit_width(batch.input_ids.cpu().numpy(), batch.attention_mask.cpu().numpy(), self.widths)
        inputs = [torch.from_numpy(np.ascontiguousarray(a)) for a in (ids, mask)] + [batch.targets.cpu().contiguous()]
        if self.b is not self._in_program:
            if self.module.named_params is None:
                self.forward_backward(*inputs)  # once, for the handle on the program's B
            (param,) = self.module.named_parameters().values()
            param.copy_(self.b)
        loss, grads, params = self.forward_backward(*inputs)
        get_sgd_optimizer(params, float(np.float32(lr))).step(grads)
        ((param,), (grad,)) = params.values(), grads.values()
        self.b = self._in_program = param.clone()
        return loss.reshape(1).clone(), grad.norm().reshape(1)
