"""The first-order peer (``shared.fo_program``) in ExecuTorch's own training runtime: its loss and B's gradient are
eager autograd's (``shared.baselines.fo_lora_loss_and_grad``) within the float32 bound, its SGD step moves B by the
step's lr times that gradient, and steps on one batch lower its loss."""

from __future__ import annotations

import pytest
import torch

from shared.baselines import fo_lora_loss_and_grad
from shared.batch import Batch
from shared.hf_models import load_model
from shared.lora import inject_lora
from tests.utils.programs import TINY_Q4
from tests.utils.tiny import random_batch
from tests.utils.tolerance import UNIT_ROUNDOFF, loss_rtol

pytestmark = pytest.mark.numerics
CFG = TINY_Q4  # the program a server compiles for an SST-2 job of the tiny model: its rows, prompt and adapter


@pytest.fixture(scope="module")
def fo_program(tiny_model_dir, tmp_path_factory):
    """(the .pte, its weights file, its manifest), exported once per machine (``tests/utils/program_cache.py``)."""
    from shared.fo_program import export_first_order
    from shared.manifest import read_first_order_manifest
    from tests.utils.program_cache import cached_export

    store = tmp_path_factory.mktemp("first-order")
    pte = cached_export(
        "first-order",
        tiny_model_dir,
        CFG,
        store,
        lambda out, to: export_first_order(tiny_model_dir, CFG, out, to, progress=lambda _: None),
    )
    manifest = read_first_order_manifest(pte)
    return pte, pte.parent / manifest.ptd.file, manifest


@pytest.fixture(scope="module")
def eager(tiny_model_dir):
    """The model with the program's LoRA layout (the same A), for autograd."""
    model, _ = load_model(tiny_model_dir, "float32")
    lora = inject_lora(model, CFG.targets, CFG.rank, CFG.alpha, CFG.a_seed)
    model.requires_grad_(False)
    return model, lora


def _batch(seed: int, vocab: int, width: int = CFG.seq_len):
    """Rows of at most ``width`` tokens, left-padded to the program's ``seq_len`` columns, as the training loop
    builds them (the program has one width: it runs them all)."""
    batch = random_batch(CFG.batch_size, seed=seed, max_len=width, vocab=vocab, candidates=CFG.candidates)
    pad = CFG.seq_len - width
    return Batch(
        *(torch.nn.functional.pad(t, (pad, 0)) for t in (batch.input_ids, batch.attention_mask, batch.position_ids)),
        batch.targets,
        batch.candidates,
    )


def _bounds(model, loss: torch.Tensor, grad: torch.Tensor) -> tuple[float, float]:
    """(loss, gradient) bounds of a float32 program against eager: the loss's (``loss_rtol``); the gradient chains
    the same sums once forward and once backward, so twice that, relative to its largest coordinate."""
    rtol = loss_rtol(model.config)
    return rtol * float(loss.abs()), 2 * rtol * float(grad.abs().max())


def _step(fo_program):
    from benchmarks.program_steps import FirstOrderStep

    return FirstOrderStep(*fo_program)


def test_the_programs_gradient_is_autograds_at_zero_and_at_any_b(fo_program, eager):
    model, lora = eager
    step = _step(fo_program)
    batch = _batch(0, model.config.vocab_size)
    inputs = (batch.input_ids, batch.attention_mask, batch.targets)
    for b in (lora.zeros(), 0.05 * torch.randn(lora.size, generator=torch.Generator().manual_seed(1))):
        if b.abs().max() > 0:  # write B into the program, as a resumed run does
            (param,) = step.module.named_parameters().values()
            param.copy_(b)
        loss, grads, _ = step.forward_backward(*inputs)
        (grad,) = grads.values()
        want_loss, want_grad = fo_lora_loss_and_grad(model, lora, batch, b)
        loss_atol, grad_atol = _bounds(model, want_loss, want_grad)
        assert float(want_grad.abs().max()) > 100 * grad_atol  # the gradient is far above the bound: it is checked
        assert abs(float(loss) - float(want_loss)) <= loss_atol
        assert float((grad - want_grad).abs().max()) <= grad_atol


def test_a_step_moves_b_by_lr_times_the_gradient_and_steps_lower_the_loss(fo_program, eager):
    model, lora = eager
    step = _step(fo_program)
    batch = _batch(1, model.config.vocab_size, width=11)  # 5 columns of padding: they change nothing
    start = 0.05 * torch.randn(lora.size, generator=torch.Generator().manual_seed(2))
    step.b = start.clone()  # a run resumed from a checkpoint: the step writes it into the program
    lr = 0.5
    out = step(batch, seed=0, lr=lr)
    loss, grad_norm = out.losses, out.grad_norm
    want_loss, want_grad = fo_lora_loss_and_grad(model, lora, batch, start)
    loss_atol, grad_atol = _bounds(model, want_loss, want_grad)
    assert abs(float(loss) - float(want_loss)) <= loss_atol
    assert abs(float(grad_norm) - float(want_grad.norm())) <= grad_atol * lora.size**0.5
    # B - lr g: the gradient's bound times lr, and one rounding of each coordinate of B and of lr g
    moved = start - lr * want_grad
    bound = lr * grad_atol + 2 * UNIT_ROUNDOFF[torch.float32] * (start.abs() + lr * want_grad.abs())
    assert not torch.equal(step.b, start) and bool(((step.b - moved).abs() <= bound).all())
    losses = [float(loss)] + [float(step(batch, seed=0, lr=lr).losses) for _ in range(4)]
    assert losses[-1] < losses[0], losses
    assert float(fo_lora_loss_and_grad(model, lora, batch, step.b)[0]) < losses[0]
