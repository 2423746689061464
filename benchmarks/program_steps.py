"""The training loop's step (``shared.train.Step``) taken by an exported program in the ExecuTorch runtime, so that
``shared.train.train`` trains through the very program a device runs: its data, evaluation and checkpoints are the
loop's, the step is the program's (``benchmarks/accuracy.py --runner program``; ``shared.train.StepFactory``).

- ``ProgramStep``: the job's zeroth-order program (``shared.program``) in a ``device_agent.et_program.
  ProgramSession``, as the agent runs it;
- ``FirstOrderStep``: the first-order peer's program (``shared.fo_program``) in ExecuTorch's training runtime
  (``executorch.extension.training``), which no job runs (``benchmarks/peer.py``).

The loop builds its batches at the program's shape, as the agent's are.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from device_agent.batches import StepBatch, fit_width
from device_agent.et_program import ProgramSession
from device_agent.native_log import runtime_log_filtered
from shared.manifest import FirstOrderManifest, ProgramManifest
from shared.train import FirstOrderOut, ZerothOrderOut


class ProgramStep:
    """The zeroth-order program's step (a ``shared.train.ZerothOrderStep``). Each step puts ``b`` into the program,
    runs ``forward`` and reads B back: a resumed run's ``b``, set from its checkpoint, is what the next step starts
    from. The optimizer's state goes the same way (``opt_state``, as ``shared.train.MethodStep`` keeps it), and a
    private run's ``privatizer`` gives the program its clip and its g's noise."""

    def __init__(self, pte: Path, ptd: Path, eps: float, manifest: ProgramManifest) -> None:
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

    def __call__(self, batch, seed: int, lr: float) -> ZerothOrderOut:
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
        return ZerothOrderOut(torch.from_numpy(losses), torch.from_numpy(g))


class FirstOrderStep:
    """The first-order program's step (a ``shared.train.Step``): the runtime computes the loss and B's gradient
    (``forward_backward``), and the extension's SGD moves B in place at the step's lr (SGD keeps no state, so an
    optimizer per step is the same update). Returns ``FirstOrderOut`` (the loss [1], the gradient's norm [1]), as
    the eager ``fo-lora`` step does. B lives in the program (exported as zeros); a ``b`` set from outside (a resumed
    run's checkpoint) is written into the program's parameter, whose handle the runtime gives after a first call.
    Each batch runs padded or cut to the program's one width, its config's ``seq_len``."""

    def __init__(self, pte: Path, ptd: Path | None, manifest: FirstOrderManifest) -> None:
        from executorch.extension.pybindings.portable_lib import _load_for_executorch
        from executorch.extension.training import TrainingModule

        with runtime_log_filtered():
            self.module = TrainingModule(_load_for_executorch(str(pte), data_path=None if ptd is None else str(ptd)))
        self.device = torch.device("cpu")
        self.b = torch.zeros(manifest.lora_size, dtype=torch.float32)
        self._in_program = self.b  # the program's B is this tensor's value (the same object: nobody replaced it)
        self._width = manifest.config.seq_len

    def forward_backward(self, ids, mask, targets) -> tuple:
        """(loss, {name: gradient}, {name: the program's own parameter}) at the program's B."""
        loss = self.module.forward_backward("forward", [ids, mask, targets])[0]
        return loss, self.module.named_gradients(), self.module.named_parameters()

    def __call__(self, batch, seed: int, lr: float) -> FirstOrderOut:
        from executorch.extension.training import get_sgd_optimizer

        del seed  # a first-order step draws no noise
        widths = (self._width, self._width)
        ids, mask = fit_width(batch.input_ids.cpu().numpy(), batch.attention_mask.cpu().numpy(), widths)
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
        return FirstOrderOut(loss.reshape(1).clone(), grad.norm().reshape(1))
