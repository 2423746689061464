"""Quantized frozen weights: the base model's linear layers as 4-bit groupwise weights with int8 dynamic activations.

``8da4w`` is torchao's ``Int8DynamicActivationIntxWeightConfig(weight_dtype=int4, weight_granularity=PerGroup(g))``,
the ExecuTorch LLM standard, which the XNNPACK delegate runs as int8 x int4 kernels. Only the base model's
``nn.Linear`` layers change: LoRA A is a buffer (``shared.lora.MPLoRALinear.lora_A``), B and the whole ZO step
(noise, perturbed copies, losses, update) stay float32, so the step, its log and its replay keep their meaning.

Layers whose input size is not a multiple of the group (XNNPACK takes only groups that are multiples of 32) get
int8 per-channel weights instead (8da8w: same dynamic activations, one scale per output row), which XNNPACK also
runs; no model we target has such a layer (SmolLM2, TinyLlama, Llama-2: every size is a multiple of 32; the tiny
test model's MLP, 176 wide, is one). With tied embeddings ``lm_head`` is a quantized linear of its own.

The embedding table becomes int8 groupwise (``Int8Embedding``): XNNPACK has no embedding kernel and the runtime's
quantized-op library (``embedding_4bit``) is not in every runner, so the lookup is written in portable ops — gather
the int8 rows, widen, multiply by their scales — and only the looked-up rows are ever dequantized. Small models
with large vocabularies spend much of their weights there (SmolLM2: 113 MB of 540 float32), so without it the
``.ptd`` stays at about a third of float32. Eight bits, not four: a quarter of the float table is already small
beside the 4-bit linears, and the unpacking of nibbles would be more graph for little gain.

Applied to the step module by ``shared.program.build_step_module``, so the exported program and the ``torch``
device backend run the same quantized base.
"""

from __future__ import annotations

import torch
from torch import nn


def quantize_base(model: nn.Module, quantize: str, group_size: int) -> None:
    """Quantize (in place) every base ``nn.Linear`` of ``model`` as ``quantize`` says (``none``: leave it).

    ``4w`` (int4 groupwise weights, float activations, like the paper's NF4) is for eager use only. A program
    could not keep it 4-bit: with the base linears' inputs flattened to 2-D (which gets it past XNNPACK's
    ``ConvertToLinearPass``), the delegate's constant propagation folds each weight-only ``dequantize_affine`` of a
    constant into a float32 constant, so the program carries float32 linears (the tiny model: a 654 KB ``.pte``
    against 136 KB, the 500 KB of its linears as float32). ExecuTorch's XNNPACK keeps weights 4-bit only beside
    quantized activations, which is ``8da4w``.
    """
    if quantize == "none":
        return
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerAxis, PerGroup

    if quantize == "8da4w":
        grouped = Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int4, weight_granularity=PerGroup(group_size)
        )
        per_channel = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0))
    elif quantize == "4w":
        grouped = IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size))
        per_channel = IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))
    else:
        raise ValueError(f"unknown quantization {quantize!r}")
    # MPLoRALinear is no nn.Linear (its base layer is) and A enters through a functional linear of a buffer, so
    # selecting nn.Linear selects exactly the base model's linears.
    quantize_(model, grouped, filter_fn=lambda m, _: isinstance(m, nn.Linear) and m.in_features % group_size == 0)
    quantize_(model, per_channel, filter_fn=lambda m, _: isinstance(m, nn.Linear) and m.in_features % group_size != 0)
    # after the linears: a tied lm_head has by now been given its own quantized weight
    model.set_input_embeddings(Int8Embedding(model.get_input_embeddings().weight, group_size))


class Int8Embedding(nn.Module):
    """A frozen embedding table as int8 codes with one float32 scale per group of ``group_size`` columns
    (symmetric, scale = max|w| / 127 over the group; the whole row is one group where ``group_size`` does not
    divide it). A lookup returns ``code * scale``: within half a step (scale / 2) of the float table."""

    def __init__(self, weight: torch.Tensor, group_size: int) -> None:
        super().__init__()
        rows, dim = weight.shape
        group = group_size if dim % group_size == 0 else dim
        grouped = weight.detach().to(torch.float32).reshape(rows, dim // group, group)
        scales = grouped.abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / 127
        self.register_buffer("codes", torch.round(grouped / scales).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales)
        self.embedding_dim = dim

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1)
        rows = self.codes.index_select(0, flat).to(torch.float32) * self.scales.index_select(0, flat)
        return rows.reshape(*input_ids.shape, self.embedding_dim)
