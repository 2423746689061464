"""Private runs (``shared.privacy``): the accountant is dp-accounting's, a private step's g is clipped and noised, its
log holds no losses and replays to the run's B bit for bit, and a resumed private run is the uninterrupted one."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from shared import privacy
from shared.errors import DataError
from shared.replay import replay
from shared.train import LOG_FILE, METRICS_FILE, train
from shared.train_log import log_line, log_record, parse_log, read_log
from tests.shared.test_train import _config, adapter_flat_b


# The rest of the module is marked numerics (CI runs it again on ATen's portable kernels, .ci/run); the accountant
# is dp-accounting's arithmetic, with no ATen kernel in it.
def test_the_accountant_is_the_librarys_and_the_calibration_meets_its_target():
    from dp_accounting import GaussianDpEvent, NeighboringRelation, SelfComposedDpEvent
    from dp_accounting.rdp import RdpAccountant

    # With every example in every batch there is no sampling to amplify: the library's plain Gaussian, composed.
    plain = RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)
    plain.compose(SelfComposedDpEvent(GaussianDpEvent(1.3), 50))
    assert privacy.epsilon_spent(1.3, 1e-5, 50, 64, 64) == pytest.approx(plain.get_epsilon(1e-5), rel=1e-9)
    # Sampling 16 of 1,000 spends far less than the whole set each step.
    assert privacy.epsilon_spent(1.3, 1e-5, 50, 16, 1000) < plain.get_epsilon(1e-5) / 5
    for epsilon in (8.0, 1.0):
        sigma = privacy.noise_multiplier(epsilon, 1e-5, 200, 16, 1000)
        spent = privacy.epsilon_spent(sigma, 1e-5, 200, 16, 1000)
        assert epsilon * 0.99 < spent <= epsilon  # rounded up to 1e-4: never over, barely under
    assert privacy.noise_multiplier(1.0, 1e-5, 200, 16, 1000) > privacy.noise_multiplier(8.0, 1e-5, 200, 16, 1000)


def test_a_ledger_is_the_accountants_composition_of_its_runs_exactly():
    """``ledger_epsilon`` adds the runs' remembered RDP curves: bit for bit what dp-accounting's accountant gives
    composing the runs in the same order, the first time and from memory."""
    from dp_accounting import NeighboringRelation
    from dp_accounting.rdp import RdpAccountant

    from shared import accounting

    runs = [(0.9, 10, 4, 1234), (1.3, 50, 16, 1000), (0.9, 10, 4, 1234)]
    composed = RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)
    for run in runs:
        composed.compose(accounting._event(*run))
    want = float(composed.get_epsilon(1e-5))
    assert privacy.ledger_epsilon(runs, 1e-5) == want and privacy.ledger_epsilon(runs, 1e-5) == want
    assert accounting.known_rdp(runs[1]) == accounting.run_rdp(runs[1])


@pytest.mark.numerics
def test_a_private_g_is_the_clipped_mean_plus_its_noise():
    differences = torch.tensor([[0.5, -3.0, 10.0, 0.25], [-0.1, -0.2, 0.3, -50.0]])
    clipped = torch.tensor([[0.5, -1.0, 1.0, 0.25], [-0.1, -0.2, 0.3, -1.0]]).mean(dim=1)
    none = torch.zeros(2)
    assert torch.equal(privacy.private_g(differences, torch.tensor([1.0]), none), clipped)
    noisy = privacy.Privatizer.seeded(clip=1.0, std=0.3, seed=7)
    noise = noisy.noise(2)  # NumPy's generator (a device without torch draws it), float32
    assert noise.dtype == np.float32
    assert np.array_equal(noise, np.random.default_rng(7).standard_normal(2, dtype=np.float32) * np.float32(0.3))
    assert not np.array_equal(noisy.noise(2), noise)  # the generator moves on
    noise = torch.from_numpy(noise)
    assert torch.equal(privacy.private_g(differences, torch.tensor([1.0]), noise), clipped + noise)
    assert privacy.noise_std(0.8, 2.0, 4) == pytest.approx(0.8)  # sigma x the replace-one sensitivity 2C/E


@pytest.mark.numerics
def test_a_private_batch_is_a_sample_without_replacement():
    rng = np.random.default_rng(privacy.stream_seed(123, 0, 5))
    batch = privacy.private_batch(50, 16, rng)
    assert len(set(batch)) == 16 and all(0 <= i < 50 for i in batch)
    counts = np.zeros(50)
    for step in range(2000):
        counts[privacy.private_batch(50, 16, np.random.default_rng(privacy.stream_seed(123, 0, step)))] += 1
    # Each example is in a batch with probability 16/50: 640 of 2,000 steps, give or take 5 standard deviations.
    assert np.all(np.abs(counts - 640) < 5 * math.sqrt(2000 * 0.32 * 0.68))


@pytest.mark.numerics
def test_a_private_log_holds_no_losses_and_the_parser_says_so():
    private_line = log_line(log_record(0, 5, 0.01, 0.01, [0.5, -0.25], None))
    assert "losses" not in json.loads(private_line)
    assert parse_log(private_line, private=True)[0]["g"] == [0.5, -0.25]
    with pytest.raises(DataError, match="missing losses"):
        parse_log(private_line)
    with pytest.raises(DataError, match="holds no losses"):
        parse_log(log_line(log_record(0, 5, 0.01, 0.01, [0.5, -0.25], [1.0, 2.0, 3.0, 4.0])), private=True)


PRIVATE = {"steps": 6, "batch_size": 8, "q": 2, "lr": 5e-2, "eps": 1e-2, "dp_epsilon": 8.0, "dp_clip": 0.5}


@pytest.mark.numerics
def test_a_private_run_logs_bounded_g_alone_and_replays_to_its_b(tiny_model_dir, tmp_path):
    metrics = train(_config(tiny_model_dir, tmp_path / "run", **PRIVATE), progress=False)
    log = read_log(tmp_path / "run" / LOG_FILE, private=True)
    assert all("losses" not in record for record in log) and len(log) == PRIVATE["steps"]
    spent = metrics["privacy"]
    assert spent["epsilon"] <= PRIVATE["dp_epsilon"] and spent["clip"] == PRIVATE["dp_clip"]
    examples_per_query = PRIVATE["batch_size"] // PRIVATE["q"]
    bound = privacy.g_bound(PRIVATE["dp_clip"], spent["noise_multiplier"], examples_per_query, 2 * len(log))
    assert max(abs(v) for record in log for v in record["g"]) <= bound
    assert spent["noise_std"] == pytest.approx(spent["noise_multiplier"] * 2 * 0.5 / examples_per_query)
    b = adapter_flat_b(tmp_path / "run")
    assert torch.equal(replay(torch.zeros_like(b), log), b)  # the update is the logged (noised) g's
    written = (tmp_path / "run" / METRICS_FILE).read_text() + (tmp_path / "run" / LOG_FILE).read_text()
    assert "private_seed" not in written


@pytest.mark.numerics
def test_a_resumed_private_run_is_the_uninterrupted_one(tiny_model_dir, tmp_path, monkeypatch):
    """The private seed is drawn once and kept in the local checkpoint: a run in pieces draws the same batches and
    noise as one run (the seed fixed here for both, as two runs never share one)."""
    monkeypatch.setattr("shared.train.secrets.randbits", lambda bits: 20260101)
    whole = train(_config(tiny_model_dir, tmp_path / "whole", **PRIVATE), progress=False)
    first = PRIVATE | {"steps": 4, "schedule_steps": 6, "checkpoint_every": 2}
    train(_config(tiny_model_dir, tmp_path / "pieces", **first), progress=False)
    monkeypatch.setattr("shared.train.secrets.randbits", lambda bits: 1)  # a resumed run must not draw again
    pieces = train(_config(tiny_model_dir, tmp_path / "pieces", **PRIVATE | {"checkpoint_every": 2}), progress=False)
    assert torch.equal(adapter_flat_b(tmp_path / "pieces"), adapter_flat_b(tmp_path / "whole"))
    assert (tmp_path / "pieces" / LOG_FILE).read_text() == (tmp_path / "whole" / LOG_FILE).read_text()
    assert pieces["privacy"] == whole["privacy"]


@pytest.mark.numerics
def test_a_private_program_clips_and_noises_its_g_in_graph(program_factory):
    """The private program's ``forward`` takes the clip and the noise: g is the clipped mean plus that noise, the
    very float32 addition, and a clip that bites bounds every g."""
    from device_agent.batches import StepBatch
    from device_agent.et_program import ProgramSession
    from tests.utils.programs import TINY_Q4

    pte, manifest = program_factory(TINY_Q4.model_copy(update={"private": True}))
    assert manifest.config.private and manifest.inputs.forward["g_noise"] == [TINY_Q4.q]
    session = ProgramSession(pte, pte.parent / manifest.ptd.file, evaluate=False)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 300, size=(TINY_Q4.batch_size, TINY_Q4.seq_len)).astype(np.int64)
    targets = np.array([[392], [373]] * (TINY_Q4.batch_size // 2), dtype=np.int64)
    batch = StepBatch(7, 0.0, ids, np.ones_like(ids), targets)

    def g(clip: float, noise) -> np.ndarray:
        session.set_b(np.zeros(manifest.lora_size, np.float32))
        return session.step(batch, 0.0, 0.05, (clip, np.asarray(noise, np.float32)))[1]

    quiet = np.zeros(TINY_Q4.q, np.float32)
    base = g(1e6, quiet)
    assert np.abs(base).max() > 0
    noise = np.array([0.5, -0.25, 1e-3, 3.0], np.float32)
    assert np.array_equal(g(1e6, noise), base + noise)
    clip = float(np.abs(base).max() / 4)
    clipped = g(clip, quiet)
    assert np.abs(clipped).max() <= np.float32(clip) and not np.array_equal(clipped, base)


@pytest.mark.numerics
def test_a_private_run_through_its_program_logs_g_alone_and_replays(tiny_model_dir, program_factory, tmp_path):
    from benchmarks.program_steps import ProgramStep
    from tests.utils.programs import TINY_Q4

    cfg = TINY_Q4.model_copy(update={"private": True})
    pte, manifest = program_factory(cfg)
    run = {"q": 4, "batch_size": 8, "seq_len": 16, "rank": 4, "alpha": 8.0, "steps": 4, "lr": 0.5, "eps": 0.05}
    run |= {"dp_epsilon": 8.0, "dp_clip": 0.5}

    def factory(program, lora):
        assert program == cfg  # the run resolves to the private program
        return ProgramStep(pte, pte.parent / manifest.ptd.file, run["eps"], manifest)

    metrics = train(_config(tiny_model_dir, tmp_path / "run", **run), progress=False, step_factory=factory)
    log = read_log(tmp_path / "run" / LOG_FILE, private=True)
    assert len(log) == run["steps"] and metrics["privacy"]["epsilon"] <= run["dp_epsilon"]
    b = adapter_flat_b(tmp_path / "run")
    assert b.abs().max() > 0 and torch.equal(replay(torch.zeros_like(b), log), b)
