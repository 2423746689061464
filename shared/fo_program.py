"""The peer of mobizo's step: first-order LoRA-FA through ExecuTorch's own training path.

``executorch.extension.training`` runs a program exported forward *and* backward
(``torch.export.experimental._export_forward_backward``): its ``forward`` returns the loss first, and the runtime
hands back, after the program's own outputs, the gradient of every trainable parameter and the parameter itself,
which the extension's SGD then updates in place. Here the one trainable parameter is the flat LoRA B of the same
adapter coordinates a mobizo job trains (A and the base frozen, LoRA-FA), and the loss is the same function of B
(``shared.zo.path_losses`` at one path: the objective, candidates and calibration prior of the job's program), so
the two programs differ in the step alone: one backward pass against 2q perturbed forward paths.

What a device uploads differs too: a zeroth-order run's log (seeds and scalars) replays on the server, so its B is
verified (``server.verify``); a first-order run's B has nothing to replay it from. ``benchmarks/peer.py`` puts the
two side by side; ``benchmarks.program_steps.FirstOrderStep`` runs this program.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from shared import lowering
from shared.batch import Batch, position_ids
from shared.lora import MPLoRA
from shared.lowering import Methods
from shared.manifest import FIRST_ORDER, FirstOrderManifest, ProgramConfig, manifest_path
from shared.zo import path_losses


class FirstOrderLoRA(nn.Module):
    """The exportable module: ``forward`` is the loss at B, a parameter; everything else is frozen."""

    def __init__(self, model: nn.Module, lora: MPLoRA, cfg: ProgramConfig) -> None:
        super().__init__()
        model.requires_grad_(False)
        self.model = model
        self.lora = lora
        self.lora_b = nn.Parameter(lora.zeros())
        ids = torch.tensor(cfg.candidates, dtype=torch.long) if cfg.candidates else None
        self.register_buffer("candidate_ids", ids)
        self.register_buffer("candidate_prior", torch.tensor(cfg.prior, dtype=torch.float32) if cfg.prior else None)

    def forward(self, input_ids, attention_mask, targets) -> tuple[torch.Tensor]:
        """(the mean loss of the rows at B,): the loss first, as the training extension wants it."""
        batch = Batch(
            input_ids, attention_mask, position_ids(attention_mask), targets, self.candidate_ids, self.candidate_prior
        )
        return (path_losses(self.model, self.lora, batch, self.lora_b[None], copies=1)[0],)

    @staticmethod
    def example_inputs(cfg: ProgramConfig) -> Methods:
        """``forward``'s inputs: the step's ``batch_size`` rows of ``seq_len`` columns. One width: ExecuTorch's
        ``to_edge`` specializes a joint graph's dynamic columns to the example's (executorch 1.5.1), so unlike the
        zeroth-order program's, a batch runs padded to ``seq_len``."""
        ids = torch.zeros(cfg.batch_size, cfg.seq_len, dtype=torch.long)
        targets = torch.zeros(cfg.batch_size, cfg.answer_len, dtype=torch.long)
        return {"forward": ((ids, torch.ones_like(ids), targets), None)}


def export_first_order(
    model_dir: Path, cfg: ProgramConfig, out_pte: Path, store_dir: Path | None = None, progress=print
) -> FirstOrderManifest:
    """Export ``FirstOrderLoRA`` of the model in ``model_dir``, forward + backward, through the project's one
    pipeline (``shared.lowering``, ``joint``) to ``out_pte``, and its manifest beside it
    (``shared.manifest.FirstOrderManifest``); the frozen weights and the tokenizer go to ``store_dir`` (default:
    beside it), named by content. ``cfg``: the zeroth-order job's program config, whose adapter layout, objective
    and prompt shapes the peer takes; its rows are the step's ``batch_size`` examples, one path each. Returns the
    manifest."""
    from shared.files import atomic_write_bytes
    from shared.program import adapted_base

    start = lowering.start_export(model_dir, out_pte, store_dir)
    lora = adapted_base(start.model, cfg)  # the zeroth-order program's layout, A and base weights
    module = FirstOrderLoRA(start.model, lora, cfg)
    progress(f"exporting the first-order program: {cfg.batch_size} rows, seq {cfg.seq_len}, backend {cfg.backend}")
    manager = lowering.lower(
        module, module.example_inputs(cfg), cfg.backend, quantize=cfg.quantize, progress=progress, joint=True
    )
    emitted = lowering.store(manager, start.out_pte, start.store, start.tokenizer)
    manifest = FirstOrderManifest(
        kind=FIRST_ORDER,
        model=str(Path(model_dir).resolve()),
        config=cfg,
        lora_size=lora.size,
        pte=emitted.pte,
        ptd=emitted.ptd,
        tokenizer=emitted.tokenizer,
        planned_bytes=emitted.planned,
        export_seconds=round(start.seconds(), 1),
    )
    atomic_write_bytes(manifest_path(start.out_pte), manifest.to_json())
    return manifest
