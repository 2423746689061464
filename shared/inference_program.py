"""The inference program: autoregressive generation with the personal adapter, exported for the ExecuTorch runtime.

``forward(tokens [1, T], input_pos [T]) -> logits [1, T, V]`` runs T new tokens at positions ``input_pos`` (a
prompt's prefill, then one token per call) against a static KV cache of ``max_context`` positions kept in mutable
buffers and written with ``index_copy_`` (Hugging Face's ``StaticLayer``): standard ATen ops only, which the stock
runtime and the native runner have. LoRA is the one MP-LoRA layer of ``shared.lora`` with one path, its B a mutable
buffer set through ``set_lora_b``, so swapping adapters never reloads the base.

The cache is planned memory, not stored: ``set_lora_b`` zeroes it (a cache built under another adapter is stale
anyway), so a caller sets B once before the first ``forward`` and the ``.pte`` carries no cache of zeros (12 MB
for SmolLM2 at context 256).

The module is traced under the same attribute names as the training programs (``program.model.…``), so its base
weights carry the same keys, and ``shared.ptd`` writes them to the same canonical ``weights-<sha256>.ptd``: a device
holds one copy of the base for training and inference, whatever the adapters' ranks (A stays in each ``.pte``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from shared import lowering
from shared.lora import MPLoRA, inject_lora
from shared.lowering import is_frozen_weight
from shared.manifest import (
    INFERENCE_FORMAT_VERSION,
    INFERENCE_METHODS,
    InferenceConfig,
    InferenceManifest,
    manifest_path,
)
from shared.ptd import WEIGHTS_TAG

CACHE = "kv_cache"  # prefix of the KV cache buffers: mutable, zeroed by set_lora_b, in neither the .pte nor the .ptd


class InferenceModule(nn.Module):
    """A causal LM with MP-LoRA (one path) and a static KV cache; ``forward`` runs new tokens at given positions.

    Positions must continue the cache: ``input_pos`` = ``[p, p+1, …]`` where p tokens are already cached (p = 0
    starts a new sequence; what the cache held beyond p is masked out by the causal mask).
    """

    def __init__(self, model: nn.Module, lora: MPLoRA, max_context: int) -> None:
        from transformers import StaticCache
        from transformers.integrations.executorch import get_head_shapes

        super().__init__()
        self.model, self.lora, self.max_context = model, lora, max_context
        self.register_buffer("lora_b", lora.zeros())
        self.cache = StaticCache(max_cache_len=max_context, config=model.config)
        heads, head_dim = get_head_shapes(model.config)
        self.cache.early_initialization(1, heads, head_dim, torch.float32, "cpu")
        for i, layer in enumerate(self.cache.layers):
            self.register_buffer(f"{CACHE}_k_{i}", layer.keys, persistent=False)
            self.register_buffer(f"{CACHE}_v_{i}", layer.values, persistent=False)
            self.register_buffer(f"{CACHE}_len_{i}", layer.cumulative_length, persistent=False)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.cache.layers):
            # Re-bound on every call: torch.export swaps the module's buffers for traced ones, and the cache object
            # must write to those, not to the tensors it held when built.
            layer.keys, layer.values = getattr(self, f"{CACHE}_k_{i}"), getattr(self, f"{CACHE}_v_{i}")
            layer.cumulative_length = getattr(self, f"{CACHE}_len_{i}")
            layer.cumulative_length.copy_(input_pos[0])
        self.lora.apply(self.lora_b[None])
        try:
            out = self.model(input_ids=tokens, position_ids=input_pos[None], past_key_values=self.cache, use_cache=True)
        finally:
            self.lora.apply(None)
        return out.logits

    def set_lora_b(self, b_flat: torch.Tensor) -> torch.Tensor:
        """The adapter from now on, with an empty cache: the cache's memory is whatever the runtime planned until
        this first call, and what it held was computed with the previous adapter."""
        self.lora_b.copy_(b_flat)
        for i in range(len(self.cache.layers)):
            getattr(self, f"{CACHE}_k_{i}").zero_()
            getattr(self, f"{CACHE}_v_{i}").zero_()
        return self.lora_b.clone()


def build_inference_module(model: nn.Module, cfg: InferenceConfig) -> InferenceModule:
    """Inject MP-LoRA into ``model`` (in place, the training programs' layout) and wrap it with a KV cache."""
    model.config.use_cache = True
    lora = inject_lora(model, cfg.targets, cfg.rank, cfg.alpha, cfg.a_seed)
    return InferenceModule(model, lora, cfg.max_context)


def _weights_tag(node: torch.fx.Node) -> str | None:
    """The training programs' rule (everything constant but B goes to the .ptd), the KV cache excepted."""
    name = str(node.target if node.op == "get_attr" else node.name)
    return WEIGHTS_TAG if is_frozen_weight(node) and CACHE not in name else None


def _method_inputs(module: InferenceModule) -> dict[str, tuple[tuple, tuple | None]]:
    """Example inputs and dynamic shapes per method: forward takes 1..max_context tokens."""
    from torch.export import Dim

    tokens = Dim("tokens", min=1, max=module.max_context)
    example = (torch.zeros(1, 4, dtype=torch.long), torch.arange(4))
    return {
        "forward": (example, ({1: tokens}, {0: tokens})),
        "set_lora_b": ((module.lora.zeros(),), None),
    }


def export_inference_program(
    model_dir: Path, cfg: InferenceConfig, out_pte: Path, store: Path | None = None, progress=print
) -> InferenceManifest:
    """Compile the inference program of the model in ``model_dir``: ``out_pte``, its manifest beside it, and the
    weights ``.ptd`` and tokenizer content-addressed in ``store`` (default: beside the program) — the same files
    the model's training programs use."""
    from shared.files import atomic_write_bytes
    from shared.generation import stop_token_ids

    start = lowering.start_export(model_dir, out_pte, store)
    model = start.model
    module = build_inference_module(model, cfg)
    progress(f"exporting inference, context {cfg.max_context}, backend {cfg.backend} ...")
    manager = lowering.lower(module, _method_inputs(module), cfg.backend, _weights_tag, zero_buffers=("lora_b",))
    emitted = lowering.store(manager, start.out_pte, start.store, start.tokenizer)
    manifest = InferenceManifest(
        format=INFERENCE_FORMAT_VERSION,
        model=str(Path(model_dir).resolve()),
        config=cfg,
        methods=list(INFERENCE_METHODS),
        lora=module.lora.modules,
        lora_size=module.lora.size,
        vocab_size=model.config.vocab_size,
        stop_token_ids=sorted(stop_token_ids(start.tokenizer, model.generation_config.eos_token_id)),
        pte=emitted.pte,
        ptd=emitted.ptd,
        tokenizer=emitted.tokenizer,
        export_seconds=round(start.seconds(), 2),
    )
    atomic_write_bytes(manifest_path(start.out_pte), manifest.to_json())
    progress(f"wrote {start.out_pte} ({manifest.pte.size} B), {manifest.ptd.file} ({manifest.ptd.size} B)")
    return manifest
