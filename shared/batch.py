"""The batch the algorithm trains on: left-padded rows whose answers end at the last column (docs/contracts.md).

Only the type and its layout live here, so the algorithm (``shared.zo``, ``shared.program``) needs no data
loading; ``shared.data.training_batch`` builds batches from encoded examples. Torch-free at import (its tensors are
the caller's), so the device's batch building needs no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

IGNORE_INDEX = -100  # target value of columns that are not answer tokens (torch's cross_entropy default)


@dataclass
class Batch:
    """Left-padded rows of prompt + correct answer; ``targets[:, j]`` is the token at column ``T - L + j``."""

    input_ids: torch.Tensor  # [N, T] long
    attention_mask: torch.Tensor  # [N, T] long, 1 on real tokens
    position_ids: torch.Tensor  # [N, T] long, cumsum(mask) - 1 clamped at 0
    targets: torch.Tensor  # [N, L] long, IGNORE_INDEX where the column is not part of the answer
    # The classification objective: the token ids of the task's candidates [C], each one token, in label order
    # (``targets[:, -1]`` is one of them). None: the loss is the language-modelling one over the whole vocabulary.
    candidates: torch.Tensor | None = None
    # A calibrated classification objective: the prompt's content-free prior, log p_cf per candidate [C] float32
    # (``shared.calibration``), subtracted from the candidates' scores in the loss. None: uncalibrated.
    prior: torch.Tensor | None = None


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions of left-padded rows: 0 at each row's first real token (also computed in-graph by the program)."""
    return (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
