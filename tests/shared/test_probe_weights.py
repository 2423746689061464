"""Curvature probe weights (1.5-SPSA; ``shared.zo``): a clean path beside each query's pair, and each g weighted by
its probe's curvature. The weights are float64 and correctly rounded, so the eager step, the program and the
server's check compute the same bits; the update is the plain update of the weighted g, so the log replays."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from shared.errors import UsageError
from shared.replay import replay
from shared.train_log import log_line, log_record
from shared.zo import (
    CURVATURE_FLOOR,
    _query,
    curvature_weights,
    forward_losses,
    path_losses,
    perturbations,
    projected_gradients,
    step_noise,
    updated_b,
    weighted_gradients,
    zo_step,
)

pytestmark = pytest.mark.numerics
EPS = float(np.float32(1e-2))


def _by_hand(losses: np.ndarray, eps: float) -> np.ndarray:
    """The weights as the module's docstring writes them, one value at a time with Python's correctly rounded
    float64 square root, rounded to float32: 1 / max(h ** (1/8), 1)."""
    wide_eps = float(np.float32(eps))
    weights = []
    for plus, minus, clean in losses.astype(np.float64).reshape(-1, 3).tolist():
        root = abs(plus + minus - clean * 2.0) / (wide_eps * wide_eps)
        for _ in range(3):
            root = math.sqrt(root)
        weights.append(1.0 / max(root, CURVATURE_FLOOR))
    return np.asarray(weights, dtype=np.float32)


def test_the_weights_are_the_eighth_root_of_the_curvature_floored_at_one() -> None:
    rng = np.random.default_rng(0)
    losses = rng.uniform(0.0, 3.0, size=3 * 64).astype(np.float32)
    losses[:6] = [1.0, 1.0, 1.0, 0.5, 0.5, 0.5 + 1e-6]  # no curvature; a curvature under the floor
    w = curvature_weights(torch.from_numpy(losses), torch.tensor([EPS])).numpy()
    assert w.dtype == np.float32 and np.array_equal(w, _by_hand(losses, EPS))
    paths = losses.astype(np.float64).reshape(-1, 3)
    h = np.abs(paths[:, 0] + paths[:, 1] - 2 * paths[:, 2]) / np.float64(np.float32(EPS)) ** 2
    np.testing.assert_allclose(w, 1 / np.maximum(h**0.125, 1.0), rtol=2.0**-24)  # the eighth root, float32
    assert w[0] == w[1] == 1.0 and (w <= 1.0).all() and (w < 0.5).sum() > 32  # sharp probes move B less
    g = weighted_gradients(torch.from_numpy(losses), torch.tensor([EPS]))
    plain = projected_gradients(torch.from_numpy(losses.reshape(-1, 3)[:, :2].reshape(-1)), torch.tensor([EPS]))
    assert g.dtype == torch.float32 and torch.equal(g, plain * torch.from_numpy(w))
    assert (g.abs() <= plain.abs()).all()  # the bound of a g by its two losses still holds


def test_a_curvature_step_is_the_pairs_and_the_clean_path_on_each_querys_rows(tiny_model_dir: Path) -> None:
    """Eager, one pass of 3q paths: each query's +, - and clean losses are those of its rows under B + eps z,
    B - eps z and B (each path run alone, within float32 rounding); g is ``weighted_gradients`` of those losses and
    the update the plain update of that g, bit for bit."""
    from shared.hf_models import load_model
    from shared.lora import inject_lora
    from tests.utils.tiny import random_batch

    model, _ = load_model(tiny_model_dir)
    lora = inject_lora(model, ("q_proj", "v_proj"), 4, 8.0, 0)
    q, rows = 2, 4
    batch = random_batch(q * rows, seed=7, max_len=12, answer_len=1, vocab=model.config.vocab_size)
    b = torch.randn(lora.size, generator=torch.Generator().manual_seed(1)) * 0.05
    seed, lr, eps = torch.tensor([5]), torch.tensor([0.1]), torch.tensor([EPS])
    with torch.no_grad():
        losses, g, b_new = zo_step(model, lora, batch, b, seed, lr, eps, q, probe_weights="curvature")
        z = step_noise(seed, q, lora.size)
        paths = perturbations(b, z, eps, clean=True)
        alone = torch.stack(
            [
                path_losses(
                    model,
                    lora,
                    _query(batch, i * rows, (i + 1) * rows, trim=False),
                    paths[3 * i + j : 3 * i + j + 1],
                    1,
                )[0]
                for i in range(q)
                for j in range(3)
            ]
        )
    assert losses.shape == (3 * q,) and torch.equal(paths[2], b) and torch.equal(paths[5], b)
    torch.testing.assert_close(losses, alone, rtol=1e-5, atol=0)
    assert torch.equal(g, weighted_gradients(losses, eps))
    assert torch.equal(b_new, updated_b(b, z, g, lr))
    with torch.no_grad():  # the clean path is B itself: its loss is the rows' loss with B applied
        lora.apply(b[None])
        clean = forward_losses(model, _query(batch, 0, rows, trim=False)).mean()
        lora.apply(None)
    torch.testing.assert_close(losses[2], clean, rtol=1e-5, atol=0)


def test_curvature_weights_are_refused_where_they_do_not_apply(tiny_model_dir: Path, tmp_path: Path) -> None:
    from shared.manifest import ProgramConfig
    from shared.schemas import HyperParams
    from shared.train import TrainConfig, train
    from tests.shared.test_train import TRAIN
    from tests.utils.programs import TINY_Q4

    for other in ({"parallel": "outer"}, {"private": True}):
        with pytest.raises(ValueError, match="probe_weights"):
            ProgramConfig.model_validate(TINY_Q4.model_dump() | {"probe_weights": "curvature"} | other)
    with pytest.raises(ValueError, match="probe_weights"):
        HyperParams(probe_weights="curvature", privacy={"epsilon": 8.0, "min_examples": 100})
    with pytest.raises(UsageError) as caught:
        train(TrainConfig(tiny_model_dir, "sst2", TRAIN, tmp_path, probe_weights="curvature", method="fo-lora"))
    assert caught.value.field == "probe_weights" and not any(tmp_path.iterdir())


def test_a_curvature_program_is_its_eager_step_and_its_log_replays_and_passes_the_servers_check(
    one_layer_model_dir: Path, one_layer_program_factory, tmp_path: Path
) -> None:
    """The .pte's losses [3q] are the eager step module's from the same B (within the float32 bound across
    kernels); its g is ``weighted_gradients`` of its own losses, bit for bit; the log replays to its B bit for bit
    and passes the server's checks; the same log with unweighted g, or without the clean losses, is refused."""
    from server.verify import ResultRejected, read_checked_log
    from shared.hf_models import load_model
    from shared.noise import step_seed
    from shared.program import build_step_module
    from tests.shared.test_program import _batches, assert_same_step_losses
    from tests.shared.test_zo_optim import Session
    from tests.utils.programs import TINY_Q4

    cfg = TINY_Q4.model_copy(update={"probe_weights": "curvature", "seq_len": 4})
    pte, manifest = one_layer_program_factory(cfg)
    assert manifest.config.probe_weights == "curvature" and "probe_weights" in manifest.config.model_dump()
    eager = build_step_module(load_model(one_layer_model_dir)[0], cfg)
    device, d = Session(pte, manifest), manifest.lora_size
    device.session.set_b(np.zeros(d, np.float32))
    spec = {"steps": 6, "seed": 3, "q": cfg.q, "eps": EPS, "lr": 0.2, "lr_schedule": "constant"}
    spec |= {"probe_weights": "curvature", "optimizer": "sgd"}
    log, weights = [], []
    for k, batch in enumerate(_batches(cfg, eager.model.config.vocab_size)[:6]):
        seed, lr = step_seed(spec["seed"], k), float(np.float32(0.2))
        with torch.no_grad():
            eager.set_lora_b(torch.from_numpy(device.session.get_b()))
            inputs = (batch.input_ids, batch.attention_mask, batch.targets)
            want = eager(*inputs, torch.tensor([seed]), torch.tensor([lr]), torch.tensor([EPS]))[0].clone()
        losses, g = device.step(batch, seed, lr)
        assert losses.shape == (3 * cfg.q,)
        assert_same_step_losses(losses, want, eager.model.config)
        assert torch.equal(g, weighted_gradients(losses, torch.tensor([EPS])))
        weights += curvature_weights(losses, torch.tensor([EPS])).tolist()
        log.append(log_record(k, seed, lr, EPS, g, losses))
    assert min(weights) < 1.0  # the weighting took part
    b = torch.from_numpy(device.session.get_b())
    assert b.abs().max() > 0 and torch.equal(replay(torch.zeros(d), log), b)
    path = tmp_path / "log.jsonl"
    path.write_text("".join(log_line(r) + "\n" for r in log))
    assert len(read_checked_log(str(path), spec)) == 6
    unweighted = [
        r | {"g": projected_gradients(torch.tensor(r["losses"]).reshape(-1, 3)[:, :2].reshape(-1), EPS).tolist()}
        for r in log
    ]
    pairs_only = [r | {"losses": np.asarray(r["losses"]).reshape(-1, 3)[:, :2].reshape(-1).tolist()} for r in log]
    for forged, words in ((unweighted, "curvature weight"), (pairs_only, f"needs {3 * cfg.q} losses")):
        path.write_text("".join(json.dumps(r) + "\n" for r in forged))
        with pytest.raises(ResultRejected, match=words):
            read_checked_log(str(path), spec)
