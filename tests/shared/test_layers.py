"""shared.layers: the Llama norm and attention XNNPACK takes whole are Hugging Face's mathematics, and a program's
layers are one XNNPACK partition each at any width."""

from __future__ import annotations

import pytest
import torch

from shared.layers import fold_llama_layers, rotation, unfold_llama_layers
from tests.utils.tiny import random_batch
from tests.utils.tolerance import loss_rtol

pytestmark = pytest.mark.numerics


def test_the_rotation_is_rotate_half_exactly():
    """Each output is one input, negated or not, plus zeros: exact on any kernel."""
    from transformers.models.llama.modeling_llama import rotate_half

    x = torch.randn(3, 4, 7, 16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(torch.nn.functional.linear(x, rotation(16, torch.float32)), rotate_half(x))


def test_folded_layers_compute_hugging_faces_logits(tiny_model_dir):
    """Left-padded rows through the tiny Llama (4 query heads on 2 key heads, so the grouped-query fold is
    exercised): the folded model's logits on real positions are Hugging Face's, within the float32 bound of two
    orders of summation (tests/utils/tolerance.py); the layers are folded only where asked."""
    from transformers.models.llama.modeling_llama import LlamaAttention

    from shared.hf_models import load_model

    model, _ = load_model(tiny_model_dir)
    attention = next(m for m in model.modules() if isinstance(m, LlamaAttention))
    assert "forward" in vars(attention) and model.config.num_key_value_heads < model.config.num_attention_heads
    batch = random_batch(6, seed=4, max_len=16, vocab=model.config.vocab_size)
    inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
    with torch.no_grad():
        folded = model(**inputs, position_ids=batch.position_ids).logits
        reference = unfold_llama_layers(model)(**inputs, position_ids=batch.position_ids).logits
        assert "forward" not in vars(attention)
        again = fold_llama_layers(model)(**inputs, position_ids=batch.position_ids).logits
    real = batch.attention_mask.bool()
    atol = loss_rtol(model.config) * float(reference[real].abs().max())
    torch.testing.assert_close(folded[real], reference[real], rtol=0, atol=atol)
    assert torch.equal(again, folded)


def test_a_programs_layers_are_one_xnnpack_partition_each(program_factory, tiny_model_dir):
    """The suite's four-query program at a symbolic width (3 to 16 columns): ``evaluate`` runs the model in at most
    one XNNPACK partition per layer and one for the head (Hugging Face's layers made eleven a layer)."""
    import json

    from executorch.exir._serialize._program import deserialize_pte_binary

    from tests.utils.programs import TINY_Q4

    pte, manifest = program_factory(TINY_Q4)
    assert manifest.config.widths is not None
    program = deserialize_pte_binary(pte.read_bytes())
    delegates = {
        plan.name: sum(type(i.instr_args).__name__ == "DelegateCall" for i in plan.chains[0].instructions)
        for plan in getattr(program, "program", program).execution_plan
    }
    layers = json.loads((tiny_model_dir / "config.json").read_text())["num_hidden_layers"]
    assert 0 < delegates["evaluate"] <= layers + 1, delegates
