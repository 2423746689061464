"""Quantized frozen weights (8da4w): the program runs the eager quantized step, keeps every weight in the .ptd,
replays bit-exactly, and its projected gradients keep the float32 program's signs."""

import pytest
import torch

from server.compile import program_key
from shared.hf_models import load_model
from shared.manifest import ProgramConfig
from shared.program import build_step_module
from shared.replay import replay
from shared.train_log import log_record
from tests.shared.test_program import Device
from tests.utils.programs import TINY_Q1, TINY_Q4, TINY_Q4_8DA4W
from tests.utils.tiny import random_batch
from tests.utils.tolerance import loss_rtol

pytestmark = pytest.mark.numerics  # CI runs these again on ATen's portable kernels (.ci/run)

STEPS, LR, EPS = 12, 0.2, 1e-2
# Measured on this tiny model (random batches as below, 40 steps x 4 queries, B along the float32 run, eager):
# 8da4w agrees in sign with float32 on 121/160 g's at eps 1e-3, 143/160 at 1e-2, 148/160 at 1e-1; int4
# weight-only on 146, 145, 148. So about 0.9 at the default eps, limited there by the weights' quantization
# itself (weight-only does no better). 0.8 leaves room for the runtime's kernels; a wrong quantization (scales,
# rows, signs) falls to chance, 0.5. The 90% target for a default is not met: the default stays ``none``.
MIN_SIGN_AGREEMENT = 0.8


@pytest.fixture(scope="module")
def quantized(program_factory):
    pte, manifest = program_factory(TINY_Q4_8DA4W)
    return pte.parent, manifest


def _step_module(tiny_model_dir, cfg: ProgramConfig):
    model, _ = load_model(tiny_model_dir)
    return build_step_module(model, cfg)


def _pte_tensor_data(pte) -> tuple[int, list[int]]:
    """What tensor data the .pte itself carries: (bytes of constants, the size of each named entry — where XNNPACK
    puts the weights it takes, named by their content's hash)."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    pte_file = deserialize_pte_binary(pte.read_bytes())
    constants = sum(len(buffer.storage) for buffer in pte_file.program.constant_buffer)
    named = pte_file.named_data
    if named is None:
        return constants, []
    return constants, [len(named.buffers[entry.buffer_index]) for entry in named.pte_data.values()]


def test_quantized_program_runs_the_eager_quantized_step_and_replays_bit_exactly(quantized, tiny_model_dir):
    """Losses within the quantization's own effect on them; the log replays B bit for bit (replay needs no model).

    Tolerance: the runtime (XNNPACK int8 x int4 kernels) and torchao's eager reference quantize the same float
    activations per token with the same int8 scheme and multiply by the same int4 weights. They differ in float
    rounding (scales, zero points, sums: ``loss_rtol``) and, where that rounding puts an activation on the other
    side of a half step, in that activation's int8 value by one step. Quantizing moves every activation by up to
    half a step, so that sparse disagreement is bounded by the quantization's whole effect on the loss, measured on
    the same batch and B as |L(8da4w eager) - L(float32 eager)|.
    """
    folder, manifest = quantized
    device = Device(manifest, folder)
    eager_q, eager_f = _step_module(tiny_model_dir, TINY_Q4_8DA4W), _step_module(tiny_model_dir, TINY_Q4)
    config, log, margins = eager_f.model.config, [], []
    for k in range(STEPS):
        batch = random_batch(8, seed=2000 + k, max_len=TINY_Q4.seq_len, answer_len=TINY_Q4.answer_len, vocab=512)
        args = (batch.input_ids, batch.attention_mask, batch.targets, torch.tensor([k]), torch.tensor([LR]))
        with torch.no_grad():
            for eager in (eager_q, eager_f):
                eager.lora_b.copy_(device.b())
            want, _ = eager_q(*args, torch.tensor([EPS]))
            floats, _ = eager_f(*args, torch.tensor([EPS]))
        losses, g = device.step(batch, seed=k)
        atol = float((want - floats).abs().max()) + loss_rtol(config) * float(want.abs().max())
        torch.testing.assert_close(losses, want, rtol=0, atol=atol)
        margins.append(float((losses - want).abs().max()) / atol)
        log.append(log_record(k, k, LR, EPS, g, losses))
    assert max(margins) < 1  # (checked above; kept to print the margins if it fails)
    final = device.b()
    assert final.abs().max() > 0
    assert torch.equal(replay(torch.zeros_like(final), log), final)


def test_projected_gradients_keep_the_float32_signs(quantized, tiny_model_dir):
    """From the same B, seed and batch, sign(g) of the 8da4w program vs the float32 step (point 5 of issue 11)."""
    folder, manifest = quantized
    device, eager_f = Device(manifest, folder), _step_module(tiny_model_dir, TINY_Q4)
    agree = total = 0
    for k in range(STEPS):
        batch = random_batch(8, seed=3000 + k, max_len=TINY_Q4.seq_len, answer_len=TINY_Q4.answer_len, vocab=512)
        with torch.no_grad():
            eager_f.lora_b.copy_(device.b())
            args = (torch.tensor([k]), torch.tensor([LR]), torch.tensor([EPS]))
            _, g_float = eager_f(batch.input_ids, batch.attention_mask, batch.targets, *args)
        _, g = device.step(batch, seed=k)
        agree += int((torch.sign(g) == torch.sign(g_float)).sum())
        total += g.numel()
    assert agree / total >= MIN_SIGN_AGREEMENT, f"{agree}/{total} signs agree"


def test_pte_holds_no_weight_and_the_ptd_is_smaller(quantized, program_factory):
    """Every frozen tensor of the base (4-bit weights, scales, zero points, embeddings) is in the shared .ptd; the
    .pte holds the frozen A alone (the job's, not the model's: XNNPACK's copy as named entries, the portable ops'
    as constants)."""
    folder, manifest = quantized
    float_pte, float_manifest = program_factory(TINY_Q4)
    a_sizes = {4 * manifest.config.rank * m.in_features for m in manifest.lora}  # bytes of one module's A
    a_bytes = 4 * manifest.config.rank * sum(m.in_features for m in manifest.lora)
    for pte in (folder / manifest.pte.file, float_pte):
        constants, named = _pte_tensor_data(pte)
        assert set(named) <= a_sizes, (named, a_sizes)  # a base weight has another shape (out x in, or 4-bit)
        # what is left beside A's copies (one per method and stage at most) are the noise generator's index
        # constants and the like, a few bytes each
        assert constants < 1024 + 2 * len(manifest.methods) * a_bytes
    assert manifest.ptd.sha256 != float_manifest.ptd.sha256
    # issue 11's target, which needs the embedding quantized too: 4-bit linears alone left 0.32x here
    assert manifest.ptd.size <= 0.3 * float_manifest.ptd.size
    assert manifest.config.quantize == "8da4w" and manifest.lora == float_manifest.lora


@pytest.mark.parametrize("dim", [64, 40])
def test_int8_embedding_lookups_are_within_half_a_step_of_the_float_table(dim):
    """Each looked-up value is code x scale with |w / scale - code| <= 1/2, so |lookup - w| <= scale / 2, up to
    float32 rounding (half an ulp, 2^-24 relative) of w / scale and of code x scale: 2^-24 |w| + 2^-24 (|w| +
    scale / 2). A 40-wide table is not divisible by the group (32), so each of its rows is one group."""
    from shared.quantize import Int8Embedding

    weight = torch.randn(100, dim, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, dim)
    table = Int8Embedding(weight, group_size=32)
    ids = torch.tensor([[0, 5, 99], [5, 7, 1]])
    looked_up, expected = table(ids), weight[ids]
    group = 32 if dim % 32 == 0 else dim
    scale = table.scales.expand(-1, -1, group).reshape(100, dim)[ids]
    assert table.scales.shape == (100, dim // group, 1)
    bound = scale / 2 * (1 + 2.0**-23) + 2.0**-23 * expected.abs()
    assert looked_up.shape == (2, 3, dim) and table.codes.dtype == torch.int8
    assert bool(((looked_up - expected).abs() <= bound).all())
    assert bool((looked_up[0, 1] == looked_up[1, 0]).all())


def test_8da4w_programs_of_other_shapes_share_one_ptd(quantized, program_factory):
    """q, batch size, the parallel schedule and the LoRA layout (TINY_Q1 is rank 2, TINY_Q4 rank 4) change the
    programs, not the base: every 8da4w program of a model with one (quantization, group size) names the same .ptd
    (as float32 ones do). The other program also has one width (3 columns: nothing symbolic, a cheaper export)."""
    _, manifest = quantized
    _, other = program_factory(TINY_Q1.model_copy(update={"quantize": "8da4w", "seq_len": 3}))
    assert (other.config.q, other.config.batch_size, other.config.rank) != (
        manifest.config.q,
        manifest.config.batch_size,
        manifest.config.rank,
    )
    assert other.config.widths is None and manifest.config.widths is not None
    assert other.ptd == manifest.ptd


def test_quantization_is_part_of_the_program_key():
    config = TINY_Q4.model_dump(mode="json")
    keys = {
        program_key("model", {**config, **change}, 1)
        for change in ({}, {"quantize": "8da4w"}, {"quantize": "8da4w", "group_size": 64})
    }
    assert len(keys) == 3


def test_group_size_must_be_a_multiple_of_32_and_old_specs_mean_float32():
    with pytest.raises(ValueError, match="group_size"):
        ProgramConfig(q=1, batch_size=2, seq_len=16, answer_len=2, quantize="8da4w", group_size=48)
    spec = {"q": 1, "batch_size": 2, "seq_len": 16, "rank": 4, "alpha": 8, "targets": ["q_proj"], "a_seed": 0}
    cfg = ProgramConfig.from_spec({**spec, "program_backend": "xnnpack"}, answer_len=2)
    assert (cfg.quantize, cfg.group_size) == ("none", 32)
