"""The ZO step: four schedules of the same mathematics, MeZO-LoRA = MobiZO q=1, first-order gradient vs FD."""

import pytest
import torch

from shared.backends import PARALLEL_MODES
from shared.baselines import fo_lora_loss_and_grad, mezo_lora_step, mezo_step
from shared.hf_models import float64_throughout
from shared.lora import inject_lora
from shared.zo import path_losses, perturbations, rge_losses, step_noise, zo_step
from tests.utils.tiny import random_batch, tiny_llama
from tests.utils.tolerance import Z_MAX, loss_rtol, step_atols

pytestmark = pytest.mark.numerics  # CI runs these again on ATen's portable kernels (.ci/run)


def _setup(seed=0, dtype=torch.float32):
    model = tiny_llama(seed=seed).to(dtype)
    if dtype == torch.float64:
        float64_throughout(model)
    lora = inject_lora(model, rank=4, alpha=8, a_seed=seed)
    return model, lora


LR, EPS, STEPS = 0.05, 1e-2, 3


def _batch(q: int, step: int):
    return random_batch(q * 2, seed=100 + step, max_len=10, answer_len=2)


def _run(parallel: str, q: int, dtype: torch.dtype):
    """STEPS steps from B = 0 with the B, lr and eps in ``dtype`` (float64: z's float32 values cast exactly)."""
    model, lora = _setup(dtype=dtype)
    b = lora.zeros(dtype)
    lr, eps = torch.tensor([LR], dtype=dtype), torch.tensor([EPS], dtype=dtype)
    history = []
    for step in range(STEPS):
        losses, g, b = zo_step(model, lora, _batch(q, step), b, torch.tensor([step + 7]), lr, eps, q, parallel)
        history.append((losses, g))
    return history, b


@pytest.mark.parametrize("q", [1, 3])
@pytest.mark.parametrize("parallel", [m for m in PARALLEL_MODES if m != "both"])
def test_schedules_agree_with_both(parallel, q):
    """The schedules are one mathematics: in float64 they agree far below any effect a wrong grouping would have."""
    ref_hist, ref_b = _run("both", q, torch.float64)
    hist, b = _run(parallel, q, torch.float64)
    loss_scale = max(float(losses.abs().max()) for losses, _ in ref_hist)
    loss_atol, g_atol, b_atol = step_atols(tiny_llama().config, torch.float64, loss_scale, EPS, LR)
    for (ref_losses, ref_g), (losses, g) in zip(ref_hist, hist):
        torch.testing.assert_close(losses, ref_losses, rtol=0, atol=loss_atol)
        torch.testing.assert_close(g, ref_g, rtol=0, atol=g_atol)
    torch.testing.assert_close(b, ref_b, rtol=0, atol=STEPS * b_atol)  # the feedback between steps is far smaller
    assert b.abs().max() > 0


@pytest.mark.parametrize("parallel", [m for m in PARALLEL_MODES if m != "both"])
def test_schedules_agree_in_float32_within_the_rounding_bound(parallel):
    """One float32 step from the same B: the kernels' rounding, magnified by 1/eps in g, stays within its bound."""
    q = 3
    model, lora = _setup()
    b0 = torch.randn(lora.size, generator=torch.Generator().manual_seed(2)) * 0.01
    args = (torch.tensor([7]), torch.tensor([LR]), torch.tensor([EPS]), q)
    ref_losses, ref_g, ref_b = zo_step(model, lora, _batch(q, 0), b0, *args, "both")
    losses, g, b = zo_step(model, lora, _batch(q, 0), b0, *args, parallel)
    loss_atol, g_atol, b_atol = step_atols(model.config, torch.float32, float(ref_losses.abs().max()), EPS, LR)
    torch.testing.assert_close(losses, ref_losses, rtol=0, atol=loss_atol)
    torch.testing.assert_close(g, ref_g, rtol=0, atol=g_atol)
    # B also rounds once more in float32 where its entries are largest
    torch.testing.assert_close(b, ref_b, rtol=0, atol=b_atol + 4 * float(ref_b.abs().max()) * 2**-24)


def test_step_shapes_and_update_rule():
    model, lora = _setup()
    batch = random_batch(4, seed=3)
    b0 = torch.randn(lora.size, generator=torch.Generator().manual_seed(1)) * 0.01
    losses, g, b1 = zo_step(model, lora, batch, b0, torch.tensor([9]), torch.tensor([0.1]), torch.tensor([1e-2]), 2)
    assert losses.shape == (4,) and g.shape == (2,)
    torch.testing.assert_close(g, (losses[0::2] - losses[1::2]) / 2e-2)
    from shared.zo import step_noise

    z = step_noise(torch.tensor([9]), 2, lora.size)
    torch.testing.assert_close(b1, b0 - 0.1 / 2 * (g[0] * z[0] + g[1] * z[1]))


def test_mezo_lora_equals_mobizo_with_one_query():
    """Same mathematics, walked in place: in float64 the two agree to the rounding bound over several steps."""
    model, lora = _setup(dtype=torch.float64)
    b_mezo, b_mobizo = lora.zeros(torch.float64), lora.zeros(torch.float64)
    lr, eps = torch.tensor([LR], dtype=torch.float64), torch.tensor([EPS], dtype=torch.float64)
    steps = 4
    for step in range(steps):
        batch = random_batch(4, seed=step)
        seed = torch.tensor([step])
        losses_m, g_m = mezo_lora_step(model, lora, batch, b_mezo, seed, lr, eps)
        losses, g, b_mobizo = zo_step(model, lora, batch, b_mobizo, seed, lr, eps, 1)
        loss_atol, g_atol, b_atol = step_atols(model.config, torch.float64, float(losses.abs().max()), EPS, LR)
        torch.testing.assert_close(losses_m, losses, rtol=0, atol=loss_atol)
        torch.testing.assert_close(g_m, g, rtol=0, atol=g_atol)
    # MeZO's in-place walk (+eps, -2 eps, +eps) does not restore B bit for bit: 4 more roundings of B per step.
    walk = 4 * steps * float(b_mobizo.abs().max() + EPS * Z_MAX) * 2**-53
    torch.testing.assert_close(b_mezo, b_mobizo, rtol=0, atol=steps * b_atol + walk)
    assert b_mobizo.abs().max() > 0


def test_fo_lora_gradient_matches_finite_differences():
    """In float64: central differences err by h^2/6 |L'| (truncation) plus 2 loss roundings / 2h, both < 1e-9 here."""
    model, lora = _setup(seed=4, dtype=torch.float64)
    batch = random_batch(3, seed=4, answer_len=2)
    b = torch.randn(lora.size, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 0.05
    loss, grad = fo_lora_loss_and_grad(model, lora, batch, b)
    h = 1e-4
    rounding = loss_rtol(model.config, torch.float64) * float(loss) / h  # 2 * loss_atol / (2h)
    for direction in torch.randn(3, lora.size, generator=torch.Generator().manual_seed(5), dtype=torch.float64):
        direction /= direction.norm()
        up = path_losses(model, lora, batch, (b + h * direction)[None], copies=1)
        down = path_losses(model, lora, batch, (b - h * direction)[None], copies=1)
        fd = float((up - down) / (2 * h))
        # truncation h^2/6 |L'''|: measured 7.5e-10 at h = 1e-3 and 7e-12 at h = 1e-4 (it scales as h^2)
        assert fd == pytest.approx(float(grad @ direction), rel=1e-6, abs=rounding + 1e-8)


def test_mezo_full_perturbs_and_restores_all_parameters():
    model = tiny_llama(seed=5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    losses, g = mezo_step(model, random_batch(2, seed=5), seed=3, lr=0.0, eps=1e-3)
    assert losses[0] != losses[1]
    # The walk +eps z, -2 eps z, +eps z (and the update, lr = 0) rounds each parameter 4 times: within
    # 4 u (|p| + 2 eps |z|), with z regenerated as mezo_step draws it.
    generator = torch.Generator().manual_seed(3)
    for (k, v), p in zip(model.state_dict().items(), model.parameters()):
        z = torch.randn(p.shape, generator=generator, dtype=p.dtype)
        bound = 4 * 2.0**-24 * (float(before[k].abs().max()) + 2 * 1e-3 * float(z.abs().max()))
        torch.testing.assert_close(v, before[k], rtol=0, atol=bound)
    mezo_step(model, random_batch(2, seed=5), seed=3, lr=1e-2, eps=1e-3)
    assert any(not torch.allclose(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("parallel", PARALLEL_MODES)
def test_classification_losses_are_the_cross_entropy_of_the_candidates_log_likelihoods(parallel):
    """The classification objective's path losses, every schedule: per path, the mean over its query's rows of the
    cross-entropy of the candidates' log-likelihoods at the answer position (``shared.evaluate``'s scores), computed
    here row by row in float64 from the full-vocabulary log-softmax, which the loss never forms."""
    q, candidates = 2, (5, 17, 40)
    model, lora = _setup(dtype=torch.float64)
    batch = random_batch(q * 3, seed=11, max_len=10, answer_len=1, candidates=candidates)
    b = torch.randn(lora.size, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 0.05
    z = step_noise(torch.tensor([3]), q, lora.size).to(torch.float64)
    paths = perturbations(b, z, torch.tensor([EPS], dtype=torch.float64))
    losses = rge_losses(model, lora, batch, paths, q, parallel)
    expected = []
    for j in range(2 * q):
        rows = range((j // 2) * 3, (j // 2 + 1) * 3)  # query j // 2's rows
        lora.apply(paths[j : j + 1])
        per_row = []
        for r in rows:
            keep = batch.attention_mask[r] == 1
            with torch.no_grad():
                logits = model(input_ids=batch.input_ids[r, keep][None]).logits[0, -2]
            scores = torch.log_softmax(logits, dim=-1)[list(candidates)]
            label = candidates.index(int(batch.targets[r, -1]))
            per_row.append(torch.logsumexp(scores, 0) - scores[label])
        lora.apply(None)
        expected.append(torch.stack(per_row).mean())
    loss_atol = step_atols(model.config, torch.float64, 1.0, EPS, LR)[0]
    torch.testing.assert_close(losses, torch.stack(expected), rtol=0, atol=loss_atol)
    assert losses.max() < 3 * torch.log(torch.tensor(3.0))  # the scale of 3 candidates, not of a 96-token vocabulary
