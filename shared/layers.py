"""The Llama decoder's RMSNorm, attention and MLP, written so that XNNPACK takes a whole layer at any width.

A program's ``forward`` and ``evaluate`` take any number of columns (a symbolic width, ``ProgramConfig.widths``).
XNNPACK's partitioner refuses, at such a width, a reshape with more than one size it cannot state as a number, any
slice of a tensor of symbolic shape, an ``unsqueeze`` off the last dimension, ``expand``, and a mean over the last
dimension of a rank-3 tensor. Hugging Face's Llama layer does each of them (the heads' ``view``, ``rotate_half``'s
slices, ``repeat_kv``, the rotary tables' ``unsqueeze``, RMSNorm's mean), so a SmolLM2 program was cut into 339
XNNPACK partitions, eleven a layer, with portable kernels between them; carving them out was most of an export.

Here the same mathematics avoids them:

- RMSNorm averages the squares over the last two dimensions of a ``(rows, width, hidden, 1)`` view (XNNPACK's
  global average pooling) instead of the last one of ``(rows, width, hidden)``: the same 1/hidden sum.
- ``rotate_half(x)`` is ``x @ R``, R a constant signed permutation (``linear``, which XNNPACK takes): each output
  is one input, negated or not, plus zeros, so the product is exact on any kernel.
- Every projection (attention's and the MLP's, and a LoRA term's A) takes a ``(rows * width, features)`` matrix,
  not a ``(rows, width, features)`` tensor: the same products, but a 2-D ``linear`` is one ``mm`` where a 3-D one
  is ``matmul``'s folding, which each of the export's re-traces with a symbolic width recomputes in Python (15 %
  of a profile of SmolLM2's float32 export, docs/benchmarks/export_time.md).
- Grouped-query attention folds each key head's query heads into the rows of one ``bmm``: queries
  ``(rows * kv_heads, groups * width, head_dim)`` against keys ``(rows * kv_heads, width, head_dim)``, so no key
  or value is repeated; every reshape leaves one size to infer (``-1``). The additive mask is laid out the same way
  once per forward and shared by every layer.

On this project's CPUs the folded model's logits equal Hugging Face's bit for bit (tests/shared/test_layers.py
checks them within the float32 bound of a dot product, which holds on any kernel). The KV-cache path (inference
programs, generation) is Hugging Face's, unchanged.
"""

from __future__ import annotations

import types

import torch
from torch import nn

# The rotation's buffer: a constant of the program (the .pte), not of the base model (the shared .ptd, whose
# inference programs, on Hugging Face's cached attention, have no use for it).
ROTATION = "rotate_half_weight"
MASK_ATTRIBUTE = "_mobizo_folded_mask"  # the layout-folded mask, kept on the forward's mask tensor for every layer


def rotation(head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight W of ``linear(x, W) = rotate_half(x) = cat(-x[half:], x[:half])`` over the last dimension."""
    half = head_dim // 2
    weight = torch.zeros(head_dim, head_dim, dtype=dtype)
    index = torch.arange(half)
    weight[index, index + half] = -1.0  # output j < half: -x[j + half]
    weight[index + half, index] = 1.0  # output j >= half: x[j - half]
    return weight


def rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm (float32 statistics), its mean taken over a 4-D view."""
    input_dtype = hidden_states.dtype
    hidden = hidden_states.to(torch.float32)
    rows, size = hidden.shape[0], hidden.shape[-1]
    variance = hidden.pow(2).reshape(rows, -1, size, 1).mean((2, 3), keepdim=True).reshape(rows, -1, 1)
    hidden = hidden * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden.to(input_dtype)


def _folded_mask(attention_mask: torch.Tensor, rows: int, kv_heads: int, groups: int) -> torch.Tensor:
    """The ``(rows, 1, width, width)`` additive mask as ``(rows * kv_heads, groups * width, width)``, built by the
    first layer of a forward and reused by the rest."""
    folded = getattr(attention_mask, MASK_ATTRIBUTE, None)
    if folded is None or folded.shape[0] != rows * kv_heads:
        width = attention_mask.shape[-1]
        folded = (
            attention_mask[:, :, None].expand(rows, kv_heads, groups, width, width).reshape(rows * kv_heads, -1, width)
        )
        setattr(attention_mask, MASK_ATTRIBUTE, folded)
    return folded


def attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, *args, **kwargs):
    """Hugging Face's LlamaAttention without a cache, grouped-query heads folded into the rows of one ``bmm``; with
    a cache, theirs."""
    if args or kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, *args, **kwargs)
    rows, head_dim = hidden_states.shape[0], self.head_dim
    heads, kv_heads = self.config.num_attention_heads, self.config.num_key_value_heads
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])  # (rows * width, hidden): 2-D projections
    query = self.q_proj(flat).reshape(rows, -1, heads, head_dim).transpose(1, 2)
    key = self.k_proj(flat).reshape(rows, -1, kv_heads, head_dim).transpose(1, 2)
    value = self.v_proj(flat).reshape(rows, -1, kv_heads, head_dim).transpose(1, 2)
    cos, sin = (t.reshape(rows, 1, -1, head_dim) for t in position_embeddings)
    query = query * cos + nn.functional.linear(query, getattr(self, ROTATION)) * sin
    key = key * cos + nn.functional.linear(key, getattr(self, ROTATION)) * sin
    # (rows, heads, width, d) -> (rows * kv_heads, groups * width, d): head h = k * groups + g reads key head k
    scores = torch.bmm(
        query.reshape(rows * kv_heads, -1, head_dim), key.reshape(rows * kv_heads, -1, head_dim).transpose(1, 2)
    )
    scores = scores * self.scaling
    if attention_mask is not None:
        scores = scores + _folded_mask(attention_mask, rows, kv_heads, heads // kv_heads)
    probs = torch.softmax(scores, dim=-1)
    output = torch.bmm(probs, value.reshape(rows * kv_heads, -1, head_dim))
    output = output.reshape(rows, heads, -1, head_dim).transpose(1, 2).reshape(-1, heads * head_dim)
    output = self.o_proj(output)
    return output.reshape(rows, -1, output.shape[-1]), None


def mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's LlamaMLP on the ``(rows * width, hidden)`` matrix of ``x``."""
    flat = x.reshape(-1, x.shape[-1])
    out = self.down_proj(self.act_fn(self.gate_proj(flat)) * self.up_proj(flat))
    return out.reshape(*x.shape[:-1], out.shape[-1])


def fold_llama_layers(model: nn.Module) -> nn.Module:
    """Give every Llama RMSNorm, attention and MLP of ``model`` the forwards above (in place) → the model."""
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

    weights: dict[tuple, torch.Tensor] = {}  # one tensor, shared by every layer
    for module in model.modules():
        if type(module) is LlamaRMSNorm:
            module.forward = types.MethodType(rms_norm_forward, module)
        elif type(module) is LlamaMLP:
            module.forward = types.MethodType(mlp_forward, module)
        elif type(module) is LlamaAttention:
            like = module.q_proj.weight
            key = (module.head_dim, like.dtype, like.device)
            if key not in weights:
                weights[key] = rotation(module.head_dim, like.dtype).to(like.device)
            module.register_buffer(ROTATION, weights[key], persistent=False)
            module.forward = types.MethodType(attention_forward, module)
    return model


def unfold_llama_layers(model: nn.Module) -> nn.Module:
    """Hugging Face's own forwards again (in place; the benchmarks' comparison) → the model."""
    for module in model.modules():
        if isinstance(getattr(module, "forward", None), types.MethodType) and "forward" in vars(module):
            if module.forward.__func__ in (rms_norm_forward, attention_forward, mlp_forward):
                del module.forward
    return model
