"""The zeroth-order math: RGE with q queries on the flat LoRA-B vector, and its four schedules.

One step (MobiZO, paper §3-4), with z_i = noise(seed, i*D .. (i+1)*D) for query i < q:

    losses  = [L(B + eps z_0), L(B - eps z_0), L(B + eps z_1), ...]      2q paths, query i on its own E rows
    g_i     = (losses[2i] - losses[2i+1]) / (2 eps)                      projected gradients
    B_new   = B - (lr / q) * (g_0 z_0 + g_1 z_1 + ...)                   summed left to right

``probe_weights`` "curvature" (1.5-SPSA: Chaubard, "Probe-Space Preconditioning for Fast and Stable Zero-Order
Training") adds a clean path B beside each query's pair, on the same rows (3q paths in the one pass: +, -, clean),
and weighs each g_i by its probe's curvature along z_i, h_i = |l+ + l- - 2 l0| / eps^2:

    g_i     = (l+ - l-) / (2 eps) * w_i,   w_i = 1 / max(h_i ** (1/8), 1)                  (``curvature_weights``)

so a probe whose rows sit where the loss bends sharply moves B less. w_i <= 1, so |g_i| keeps the bound of its two
losses. The weights are computed in float64 (the eighth root as three square roots) and rounded to float32 once,
so the eager step, the program's portable kernels and the server's check agree on their bits.

``parallel`` only changes how the 2q paths are grouped into forward passes (``both``: one pass of 2q paths;
``outer``: + pass and - pass of q paths; ``inner``: q passes of 2 paths; ``none``: 2q passes of 1 path); the
mathematics and therefore the losses and B are the same. lr, eps and seed are tensors (float32 / int64) so that
eager training, the exported program and the replay perform identical float32 operations. A float64 B (eager
only, for checks that rounding must not hide) runs the same steps on z's float32 values cast exactly to float64.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shared.backends import Parallel  # the schedules' names, torch-free (the command line's choices)
from shared.batch import Batch
from shared.lora import MPLoRA
from shared.noise import noise_range
from shared.privacy import private_g
from shared.zo_optim import updated_b


def example_losses(
    logits: torch.Tensor,
    targets: torch.Tensor,
    candidates: torch.Tensor | None = None,
    prior: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-example loss of the answer logits [N, L, V] (``targets`` [N, L]).

    ``candidates`` None (objective ``lm``): cross-entropy over the whole vocabulary, mean over the example's answer
    tokens. ``candidates`` [C] (objective ``classification``, single-token candidates): cross-entropy over the
    candidates' logits at the answer position, the label being the candidate ``targets[:, -1]`` holds. It equals
    the cross-entropy of the candidates' scores (their log-likelihoods, ``shared.evaluate``): the vocabulary's
    log-normaliser is the same for every candidate and cancels. ``prior`` [C] (a calibrated objective,
    ``shared.calibration``): log p_cf, subtracted from each candidate's score in float32 before the cross-entropy.
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)  # half-precision models: loss in float32
    if candidates is not None:
        scores = logits[:, -1, :].index_select(-1, candidates).to(dtype)
        if prior is not None:
            scores = scores - prior.to(dtype)
        label = (targets[:, -1:] == candidates[None, :]).to(torch.int64).argmax(dim=1)
        return nn.functional.cross_entropy(scores, label, reduction="none")
    vocab = logits.shape[-1]
    nll = nn.functional.cross_entropy(
        logits.reshape(-1, vocab).to(dtype), targets.reshape(-1), ignore_index=-100, reduction="none"
    ).reshape(targets.shape)
    counts = (targets != -100).sum(dim=-1).clamp(min=1)
    return nll.sum(dim=-1) / counts


def answer_logits(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The logits that predict each row's answer columns [N, L, V] (answers at the right edge)."""
    answer_len = batch.targets.shape[1]
    return model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        logits_to_keep=answer_len + 1,
        use_cache=False,
    ).logits[:, :-1]


def forward_losses(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Per-example losses of ``batch`` under whatever paths the LoRA layers hold (its objective: ``candidates``)."""
    return example_losses(answer_logits(model, batch), batch.targets, batch.candidates, batch.prior)


def candidate_scores(model: nn.Module, batch: Batch) -> torch.Tensor:
    """[N, C]: each single-token candidate's log-likelihood at each row's answer position (``shared.evaluate``'s
    score, in one pass for all candidates)."""
    logits = answer_logits(model, batch)[:, -1, :]
    dtype = torch.promote_types(logits.dtype, torch.float32)
    return torch.log_softmax(logits.to(dtype), dim=-1).index_select(-1, batch.candidates)


def _repeat_rows(batch: Batch, groups: int, copies: int) -> Batch:
    """Rows [g0, g1, ...] (groups of equal size) → [g0 × copies, g1 × copies, ...], path-major."""

    def rep(x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(groups, 1, shape[0] // groups, *shape[1:])
        return x.expand(groups, copies, *x.shape[2:]).reshape(groups * copies * (shape[0] // groups), *shape[1:])

    return Batch(
        rep(batch.input_ids),
        rep(batch.attention_mask),
        rep(batch.position_ids),
        rep(batch.targets),
        batch.candidates,
        batch.prior,
    )


def path_losses(
    model: nn.Module, lora: MPLoRA, batch: Batch, paths: torch.Tensor, copies: int, rows: bool = False
) -> torch.Tensor:
    """Loss of each of the n = len(paths) paths in one pass; ``batch`` holds n / copies row groups.

    Each row group is run ``copies`` times side by side (copies=2: the ± pair of one query). ``rows``: each
    example's own loss, [n, rows of a group], instead of their mean (a private step clips them one by one).
    """
    n = paths.shape[0]
    lora.apply(paths)
    try:
        losses = forward_losses(model, _repeat_rows(batch, n // copies, copies))
    finally:
        lora.apply(None)
    return losses.reshape(n, -1) if rows else losses.reshape(n, -1).mean(dim=1)


def perturbations(b: torch.Tensor, z: torch.Tensor, eps: torch.Tensor, clean: bool = False) -> torch.Tensor:
    """[2q, D]: B + eps z_0, B - eps z_0, B + eps z_1, ...; ``clean``: [3q, D], B itself after each pair."""
    ez = z * eps
    sides = [b + ez, b - ez] + ([b.expand_as(ez)] if clean else [])
    return torch.stack(sides, dim=1).reshape(-1, b.shape[0])


def projected_gradients(losses: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    pairs = losses.reshape(-1, 2)
    return (pairs[:, 0] - pairs[:, 1]) / (eps * 2)


CURVATURE_ROOTS = 3  # w_i = 1 / max(h_i ** (1 / 2**3), CURVATURE_FLOOR): 1.5-SPSA's saturating alpha near its 0.1
CURVATURE_FLOOR = 1.0  # 1.5-SPSA's lambda: a probe of curvature under 1 keeps its whole g


def curvature_weights(losses: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """[q] float32 weights of a curvature step's losses [3q] (+, -, clean per query; the module's formula)."""
    paths = losses.reshape(-1, 3).to(torch.float64)
    wide_eps = eps.to(torch.float64)
    root = (paths[:, 0] + paths[:, 1] - paths[:, 2] * 2.0).abs() / (wide_eps * wide_eps)
    for _ in range(CURVATURE_ROOTS):
        root = torch.sqrt(root)
    # Rounded once to float32 at the end, as the normalized update's root (shared.zo_optim): ATen's float64 sqrt is an
    # ulp off the correctly rounded one on some values (std::sqrt, ExecuTorch's portable kernel), which float32 hides.
    return (1.0 / torch.clamp(root, min=CURVATURE_FLOOR)).to(torch.float32)


def weighted_gradients(losses: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """g [q] of a curvature step's losses [3q]: each query's projected gradient times its weight, in float32."""
    g = projected_gradients(losses.reshape(-1, 3)[:, :2].reshape(-1), eps)
    return g * curvature_weights(losses, eps).to(g.dtype)


def step_noise(seed: torch.Tensor, q: int, size: int) -> torch.Tensor:
    """z [q, D] of one step: query i takes indices i*D .. (i+1)*D of the flat range, generated one query at a
    time so the generator's int64 temporaries hold D values, not q*D (a step's peak memory). Its NumPy twin is
    ``shared.noise.step_noise_np``."""
    return torch.stack([noise_range(seed, size, start=i * size) for i in range(q)])


def _query(batch: Batch, start: int, stop: int, trim: bool) -> Batch:
    """Rows [start, stop), with ``trim`` without their all-padding left columns (eager only: a query run alone pads
    less; a query's own column count depends on data inside the step, which an exported graph cannot follow:
    a program takes the whole batch's width from outside, ``ProgramConfig.widths``)."""
    mask = batch.attention_mask[start:stop]
    first = int(mask.any(dim=0).nonzero()[0]) if trim else 0
    return Batch(
        batch.input_ids[start:stop, first:],
        mask[:, first:],
        batch.position_ids[start:stop, first:],
        batch.targets[start:stop],
        batch.candidates,
        batch.prior,
    )


def rge_losses(
    model: nn.Module,
    lora: MPLoRA,
    batch: Batch,
    paths: torch.Tensor,
    q: int,
    parallel: Parallel,
    trim: bool = True,
    rows: bool = False,
) -> torch.Tensor:
    """The 2q path losses of one step, grouped into forward passes as ``parallel`` says.

    ``batch`` has q*E rows, query-major; ``paths`` is ``perturbations(...)`` [2q, D]. ``trim``: a query run alone
    drops its all-padding columns (eager); a program keeps the batch's columns (``trim=False``, exportable). ``rows``:
    each example's loss on each path, [2q, E].
    """
    if parallel == "both":
        return path_losses(model, lora, batch, paths, copies=2, rows=rows)
    if parallel == "outer":
        plus = path_losses(model, lora, batch, paths[0::2], copies=1, rows=rows)
        minus = path_losses(model, lora, batch, paths[1::2], copies=1, rows=rows)
        return torch.stack([plus, minus], dim=1).reshape(-1, *plus.shape[1:])
    per_query = batch.input_ids.shape[0] // q
    parts = []
    for i in range(q):
        query = _query(batch, i * per_query, (i + 1) * per_query, trim)
        if parallel == "inner":
            parts.append(path_losses(model, lora, query, paths[2 * i : 2 * i + 2], copies=2, rows=rows))
        else:
            parts += [
                path_losses(model, lora, query, paths[j : j + 1], copies=1, rows=rows) for j in (2 * i, 2 * i + 1)
            ]
    return torch.cat(parts)


def zo_step(
    model: nn.Module,
    lora: MPLoRA,
    batch: Batch,
    b: torch.Tensor,
    seed: torch.Tensor,
    lr: torch.Tensor,
    eps: torch.Tensor,
    q: int,
    parallel: Parallel = "both",
    trim: bool = True,
    clip: torch.Tensor | None = None,
    g_noise: torch.Tensor | None = None,
    apply: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    probe_weights: str = "none",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One MobiZO step → (losses [2q], g [q], new B). Used by eager training and, untrimmed, by the program.
    ``apply(b, z, g, lr) → new B``: the optimizer's update (``shared.zo_optim``; default ``updated_b``, sgd).
    ``probe_weights`` "curvature": losses [3q] (each query's +, - and clean path, in one pass: ``parallel`` "both"
    only) and g weighted by each probe's curvature (``weighted_gradients``).

    With ``clip`` [1] and ``g_noise`` [q] the step is private (``shared.privacy.private_g``): g from each example's
    difference clipped to ``clip``, plus the noise; B moves by that g, and the losses returned are for the device's
    own eyes."""
    z = step_noise(seed, q, b.shape[0]).to(b.dtype)  # a float64 B (exactness checks) takes z's float32 values
    if probe_weights == "curvature":
        if clip is not None or parallel != "both":
            raise ValueError("curvature probe weights take a non-private step of parallel 'both'")
        losses = path_losses(model, lora, batch, perturbations(b, z, eps, clean=True), copies=3)
        g = weighted_gradients(losses, eps)
        return losses, g, (apply or updated_b)(b, z, g, lr)
    paths = perturbations(b, z, eps)
    if clip is None:
        losses = rge_losses(model, lora, batch, paths, q, parallel, trim)
        g = projected_gradients(losses, eps)
    else:
        per_example = rge_losses(model, lora, batch, paths, q, parallel, trim, rows=True)
        g = private_g((per_example[0::2] - per_example[1::2]) / (eps * 2), clip, g_noise)
        losses = per_example.mean(dim=1)
    return losses, g, (apply or updated_b)(b, z, g, lr)
