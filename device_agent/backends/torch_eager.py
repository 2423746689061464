"""The ``torch`` backend: the program's step module (``shared.program.build_step_module``) run eagerly in PyTorch,
on CUDA when present — the Jetson path of the paper.

A device receives the ``.pte``, the ``.ptd`` and the tokenizer, and PyTorch runs none of them, so this backend
needs the base model as a Hugging Face directory on the device (``mobizo agent run --model-dir DIR``). Before the
first step it checks that this model is the program's: its content hash must be one the server has registered
(``GET /v1/models``), its tokenizer must be the program's (sha256 in the manifest) and its LoRA modules the
program's (names and shapes). Then the eager step is the program's step: same batches, same log; the losses agree
with the ``.pte`` within float tolerance (other kernels), and the log replays to B exactly on CPU and within the
server's tolerance on CUDA.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from device_agent.backends import TrainRun
from device_agent.backends.local import LocalBackend
from device_agent.batches import StepBatch, fit_width
from shared.errors import MobizoError
from shared.manifest import ProgramManifest


class TorchSession:
    """The step module of a program, built from the local base model, around its master B."""

    def __init__(self, model_dir: Path, manifest: ProgramManifest, device: str | None = None) -> None:
        import torch

        from shared.hf_models import load_model
        from shared.program import build_step_module
        from shared.train import resolve_device

        self.device = resolve_device(device)
        model, tokenizer = load_model(Path(model_dir), "float32", str(self.device))
        _check_tokenizer(model_dir, tokenizer, manifest)
        self.module = build_step_module(model, manifest.config)
        self.widths = manifest.inputs.widths  # the columns the program would run a batch at (fit_width)
        if self.module.lora.modules != manifest.lora:
            raise MobizoError(f"{model_dir}: its LoRA modules differ from the program's: not the job's base model")
        self._torch = torch

    def _tensor(self, values: Any, dtype: Any) -> Any:
        return self._torch.as_tensor(np.asarray(values), dtype=dtype).to(self.device)

    def get_b(self) -> np.ndarray:
        return self.module.get_lora_b().cpu().numpy().copy()

    def set_b(self, b: np.ndarray) -> None:
        self.module.set_lora_b(self._tensor(b, self._torch.float32))  # and the optimizer's state from zeros

    def set_state(self, state: np.ndarray) -> None:
        self.module.set_opt_state(self._tensor(state, self._torch.float32))

    def step(
        self, batch: StepBatch, lr: float, eps: float, private: tuple[float, np.ndarray] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        torch = self._torch
        ids, mask = fit_width(batch.input_ids, batch.attention_mask, self.widths)
        extra = ()
        if private is not None:  # a private step: the clip and the noise of its g's
            extra = (self._tensor([private[0]], torch.float32), self._tensor(private[1], torch.float32))
        with torch.no_grad():
            losses, g = self.module(
                self._tensor(ids, torch.long),
                self._tensor(mask, torch.long),
                self._tensor(batch.targets, torch.long),
                self._tensor([batch.seed], torch.long),
                self._tensor([lr], torch.float32),
                self._tensor([eps], torch.float32),
                *extra,
            )
        return losses.cpu().numpy().copy(), g.cpu().numpy().copy()


def _check_tokenizer(model_dir: Path, tokenizer: Any, manifest: ProgramManifest) -> None:
    from shared.tokenizer_file import tokenizer_bytes

    if hashlib.sha256(tokenizer_bytes(tokenizer)).hexdigest() != manifest.tokenizer.sha256:
        raise MobizoError(f"{model_dir}: its tokenizer is not the program's: not the job's base model")


@lru_cache(maxsize=4)
def _content_hash(model_dir: Path) -> str:
    from shared.model_files import model_sha256  # a model's identity, as the server registers it

    return model_sha256(model_dir)


def torch_backend(
    model_dir: Path, device: str | None = None, registered: Callable[[], set[str]] | None = None
) -> LocalBackend:
    """The eager backend on the base model in ``model_dir``; ``registered()``: the server's model hashes."""
    model_dir = Path(model_dir).resolve()
    if not (model_dir / "config.json").is_file():
        raise MobizoError(f"{model_dir}: not a Hugging Face model directory (no config.json)")

    def open_engine(run: TrainRun) -> TorchSession:
        if registered is not None and _content_hash(model_dir) not in registered():
            raise MobizoError(f"{model_dir}: this model is not one the server has registered (content hash differs)")
        return TorchSession(model_dir, run.manifest, device)

    return LocalBackend("torch", open_engine)
