"""MP-LoRA layers: exact base behaviour at B = 0, n paths in one pass = each path alone, targets."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from shared.errors import UsageError
from shared.lora import MPLoRALinear, inject_lora, lora_a_init
from shared.zo import forward_losses, path_losses
from tests.utils.tiny import random_batch, tiny_llama
from tests.utils.tolerance import loss_rtol

pytestmark = pytest.mark.numerics  # CI runs these again on ATen's portable kernels (.ci/run)


def _logits(model, batch):
    return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids).logits


def test_zero_b_gives_exactly_the_base_logits():
    base = tiny_llama(seed=1)
    batch = random_batch(4, seed=1)
    expected = _logits(base, batch)
    lora = inject_lora(base, rank=4, alpha=8)
    lora.apply(lora.zeros()[None])
    assert torch.equal(_logits(base, batch), expected)
    lora.apply(None)
    assert torch.equal(_logits(base, batch), expected)


def test_injects_the_default_targets_with_frozen_seeded_a():
    model = tiny_llama(layers=3)
    lora = inject_lora(model)
    assert [m.name for m in lora.modules] == [
        f"model.layers.{i}.self_attn.{p}" for i in range(3) for p in ("q_proj", "v_proj")
    ]
    layer = model.get_submodule("model.layers.1.self_attn.v_proj")
    assert isinstance(layer, MPLoRALinear) and layer.rank == 16 and layer.scaling == 2.0
    assert torch.equal(layer.lora_A, lora_a_init(0, "model.layers.1.self_attn.v_proj", 16, 32))
    assert not torch.equal(layer.lora_A, lora_a_init(1, "model.layers.1.self_attn.v_proj", 16, 32))
    assert lora.size == sum(m.out_features * 16 for m in lora.modules)
    assert not any(p.requires_grad for p in model.parameters())


def test_unknown_target_is_a_usage_error():
    with pytest.raises(UsageError, match="--targets.*nope"):
        inject_lora(tiny_llama(), targets=("q_proj", "nope"))


def test_paths_in_one_pass_equal_each_path_alone():
    model = tiny_llama(seed=2)
    lora = inject_lora(model, rank=4, alpha=8)
    batch = random_batch(3, seed=2)
    paths = torch.randn(5, lora.size, generator=torch.Generator().manual_seed(0)) * 0.1
    together = path_losses(model, lora, batch, paths, copies=5)
    alone = torch.stack([path_losses(model, lora, batch, paths[j : j + 1], copies=1)[0] for j in range(5)])
    torch.testing.assert_close(together, alone, rtol=loss_rtol(model.config), atol=0)  # other batch shapes
    assert len(set(alone.tolist())) == 5  # the paths really differ


def test_split_and_join_round_trip():
    lora = inject_lora(tiny_llama(), rank=4)
    b = torch.arange(lora.size, dtype=torch.float32)
    assert torch.equal(lora.join(lora.split(b)), b)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_configs(family):
    kw = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = (Qwen2ForCausalLM(Qwen2Config(**kw)) if family == "qwen2" else Qwen3ForCausalLM(Qwen3Config(**kw))).eval()
    batch = random_batch(2, vocab=64)
    before = forward_losses(model, batch)
    lora = inject_lora(model, rank=2, alpha=4)
    assert len(lora.modules) == 4
    lora.apply(lora.zeros()[None])
    torch.testing.assert_close(forward_losses(model, batch), before, rtol=0, atol=0)
