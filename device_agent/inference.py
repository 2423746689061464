"""The inference program loaded in the ExecuTorch Python runtime: base weights once, adapters swapped through B.

``InferenceSession`` is the ``shared.generation`` step of the device: prefill and decode through the program's
``forward``, the KV cache inside the program. Swapping an adapter is one ``set_lora_b`` call; the ``.pte`` and the
weights ``.ptd`` are loaded once per session (``loads`` counts it, for the tests and the figures).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from device_agent.et_runtime import runtime
from device_agent.native_log import runtime_log_filtered
from shared.manifest import INFERENCE_METHODS, InferenceManifest


class InferenceSession:
    """The program's methods, loaded once; ``set_b`` switches adapters (None: the base model, B = 0)."""

    loads = 0  # program loads in this process, all sessions together

    def __init__(self, pte: Path, ptd: Path, manifest: InferenceManifest) -> None:
        with runtime_log_filtered():
            program = runtime().load_program(Path(pte), data_path=Path(ptd))
            missing = set(INFERENCE_METHODS) - program.method_names
            if missing:
                raise ValueError(f"{pte}: not a mobizo inference program (missing {sorted(missing)})")
            # All methods before any runs: loading a method re-initialises the shared B and cache buffers.
            self._methods = {name: program.load_method(name) for name in INFERENCE_METHODS}
        InferenceSession.loads += 1
        self._program, self.manifest = program, manifest
        self.set_b(None)  # the program's contract: B set (and the KV cache emptied) before the first forward

    @property
    def max_context(self) -> int:
        return self.manifest.config.max_context

    def set_b(self, b: np.ndarray | None) -> None:
        """Run with this adapter's flat B from now on (None: zeros, the base model); the KV cache starts empty."""
        size = self.manifest.lora_size
        flat = np.zeros(size, dtype=np.float32) if b is None else np.asarray(b, dtype=np.float32).reshape(-1)
        if flat.size != size:
            raise ValueError(f"B has {flat.size} values, the program's LoRA layout needs {size}")
        self._methods["set_lora_b"].execute([torch.from_numpy(flat.copy())])

    def logits(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """Logits [1, T, V] of T new tokens at positions ``input_pos`` (continuing the cached ones)."""
        end = int(input_pos[-1]) + 1
        if end > self.max_context:
            raise ValueError(f"position {end - 1} is beyond the program's context of {self.max_context}")
        return self._methods["forward"].execute([tokens.to(torch.long), input_pos.to(torch.long)])[0].clone()

    def __call__(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """``shared.generation.Step``: the logits of the last new position."""
        return self.logits(tokens, input_pos)[0, -1]
