"""The device program: the .pte trains exactly like the eager step module, replays bit-exactly, shares weights."""

import math
import shutil
from pathlib import Path

import pytest
import torch

from shared.adapter import save_lora
from shared.b_file import read_b_file
from shared.errors import UsageError
from shared.hf_models import load_model
from shared.manifest import ProgramManifest, manifest_path, read_manifest
from shared.program import build_step_module, start_from_adapter
from shared.replay import replay
from shared.train_log import log_record
from tests.utils.programs import TINY_Q1, TINY_Q4, TINY_TEXT, weights_files
from tests.utils.tiny import random_batch
from tests.utils.tolerance import b_drift, loss_rtol, step_atols

pytestmark = pytest.mark.numerics  # CI runs these again on ATen's portable kernels (.ci/run)

STEPS, LR, EPS = 20, 0.2, 1e-2


def assert_same_step_losses(got: torch.Tensor, want: torch.Tensor, config) -> None:
    """The .pte (XNNPACK kernels) and eager ATen from the same B: within the float32 rounding bound of a loss."""
    atol = loss_rtol(config) * float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=0, atol=atol)


def _batches(cfg, vocab: int):
    """Random batches of a program's shape; a classification program's answers are its candidates."""
    shape = {"max_len": cfg.seq_len, "answer_len": cfg.answer_len, "vocab": vocab, "candidates": cfg.candidates}
    return [random_batch(cfg.batch_size, seed=1000 + k, **shape) for k in range(STEPS)]


class Device:
    """The program as a device runs it: executorch.runtime, .pte + shared .ptd."""

    def __init__(self, manifest: ProgramManifest, folder: Path, store: Path | None = None) -> None:
        from executorch.runtime import Runtime

        program = Runtime.get().load_program(
            folder / manifest.pte.file, data_path=(store or folder) / manifest.ptd.file
        )
        self.methods = {m: program.load_method(m) for m in manifest.methods}

    def step(self, batch, seed: int):
        args = [
            batch.input_ids,
            batch.attention_mask,
            batch.targets,
            torch.tensor([seed]),
            torch.tensor([LR]),
            torch.tensor([EPS]),
        ]
        return [t.clone() for t in self.methods["forward"].execute(args)]

    def b(self) -> torch.Tensor:
        return self.methods["get_lora_b"].execute([])[0].clone()

    def set_b(self, b: torch.Tensor) -> None:
        self.methods["set_lora_b"].execute([b])


@pytest.fixture(scope="module")
def programs(program_factory):
    """Programs with q = 1 and q = 4 (E = 2) of the tiny model, from the session's program cache."""
    out = {cfg.q: (cfg, program_factory(cfg)[1]) for cfg in (TINY_Q1, TINY_Q4)}
    return program_factory(TINY_Q1)[0].parent, out


def _eager(tiny_model_dir, cfg):
    model, _ = load_model(tiny_model_dir)
    return build_step_module(model, cfg)


@pytest.mark.parametrize("q", [1, 4])
def test_pte_losses_equal_eager_step_by_step_and_replay_is_bit_exact(programs, tiny_model_dir, q):
    folder, by_q = programs
    cfg, manifest = by_q[q]
    device, eager = Device(manifest, folder), _eager(tiny_model_dir, cfg)
    device.set_b(torch.zeros(manifest.lora_size))  # the program carries no B: the device always sets it first
    vocab = eager.model.config.vocab_size
    log = []
    for k, batch in enumerate(_batches(cfg, vocab)):
        with torch.no_grad():
            eager.lora_b.copy_(device.b())  # same starting B each step: compare the step itself
            eager_losses, _ = eager(
                batch.input_ids,
                batch.attention_mask,
                batch.targets,
                torch.tensor([k]),
                torch.tensor([LR]),
                torch.tensor([EPS]),
            )
        losses, g = device.step(batch, seed=k)
        assert losses.shape == (2 * q,) and g.shape == (q,)
        assert_same_step_losses(losses, eager_losses, eager.model.config)
        log.append(log_record(k, k, LR, EPS, g, losses))
    final = device.b()
    assert final.abs().max() > 0
    assert torch.equal(replay(torch.zeros_like(final), log), final)  # the server's check, bit for bit


def test_a_user_s_text_trains_through_the_program_as_eager_and_its_log_replays_bit_for_bit(
    program_factory, tiny_model_dir
):
    """The per-user text (``text``: the shipped Shakespeare sample's first user, a row per line given the cue and
    the speech so far) in the batches its device builds (``step_batches``), on the program a private personal job
    compiles (``TINY_TEXT``): each step's language-modelling losses equal eager ATen's from the same B, and the
    server's replay of the log as the device uploads it (g alone, clipped and noised) is the program's B bit for
    bit."""
    import numpy as np

    from benchmarks.personal import EagerEvaluator
    from benchmarks.personal_data import split
    from device_agent.et_program import ProgramSession
    from device_agent.evaluation import evaluate_program
    from device_agent.local_data import program_shape, step_batches
    from shared.privacy import step_privatizer
    from shared.tasks import get_task
    from shared.tokenizer_file import load_tokenizer_file

    pte, manifest = program_factory(TINY_TEXT)
    cfg, eps, clip = manifest.config, float(np.float32(EPS)), float(np.float32(0.5))
    task = get_task("text")
    rows = [row for record in split()[0].train for row in task.rows(record)]
    tokenizer = load_tokenizer_file(pte.parent / manifest.tokenizer.file)
    batches = list(step_batches(rows, tokenizer, program_shape(cfg), 5, 8, LR))
    session = ProgramSession(pte, pte.parent / manifest.ptd.file, widths=manifest.inputs.widths)
    session.set_b(np.zeros(manifest.lora_size, np.float32))
    eager, log = _eager(tiny_model_dir, cfg), []
    for k, batch in enumerate(batches):
        noise = step_privatizer(7, k, clip, 0.1).noise(cfg.q)  # NumPy float32
        with torch.no_grad():
            eager.lora_b.copy_(torch.from_numpy(session.get_b()))  # the same B: compare the step itself
            columns = [torch.from_numpy(a).long() for a in (batch.input_ids, batch.attention_mask, batch.targets)]
            numbers = [torch.tensor([v], dtype=torch.float32) for v in (batch.lr, eps, clip)]
            eager_losses, _ = eager(*columns, torch.tensor([batch.seed]), *numbers, torch.from_numpy(noise))
        losses, g = session.step(batch, batch.lr, eps, (clip, noise))
        assert (batch.targets >= 0).sum(axis=1).min() > 1  # the rows' answers are lines, not single tokens
        assert_same_step_losses(torch.from_numpy(losses), eager_losses, eager.model.config)
        log.append(log_record(k, batch.seed, batch.lr, eps, g, None))
    final = torch.from_numpy(session.get_b())
    assert final.abs().max() > 0
    assert torch.equal(replay(torch.zeros_like(final), log), final)
    # the device's held-out figures: the per-token loss of the user's later speeches and its perplexity
    held_out = [row for record in split()[0].held_out for row in task.rows(record)]
    found = evaluate_program(session, held_out, tokenizer, program_shape(cfg), "lm")
    eager.lora_b.copy_(final)
    expected = evaluate_program(EagerEvaluator(eager, cfg.widths), held_out, tokenizer, program_shape(cfg), "lm")
    assert found["n"] == expected["n"] == len(held_out) and found["accuracy"] is None
    assert found["loss"] == pytest.approx(expected["loss"], rel=loss_rtol(eager.model.config))
    assert found["perplexity"] == math.exp(found["loss"])


def test_free_running_eager_training_tracks_the_program(programs, tiny_model_dir):
    """Each on its own B for 20 steps: the B's differ only by what their g's differ by (the update rule is one)."""
    folder, by_q = programs
    cfg, manifest = by_q[4]
    device, eager = Device(manifest, folder), _eager(tiny_model_dir, cfg)
    device.set_b(torch.zeros(manifest.lora_size))
    g_device, g_eager = [], []
    with torch.no_grad():
        for k, batch in enumerate(_batches(cfg, eager.model.config.vocab_size)):
            g_device.append(device.step(batch, seed=k)[1])
            args = (torch.tensor([k]), torch.tensor([LR]), torch.tensor([EPS]))
            g_eager.append(eager(batch.input_ids, batch.attention_mask, batch.targets, *args)[1].clone())
    drift = b_drift(g_device, g_eager, LR)[-1]
    assert eager.lora_b.abs().max() > 10 * drift  # the bound says something about B
    torch.testing.assert_close(device.b(), eager.lora_b, rtol=0, atol=drift)


@pytest.mark.parametrize("parallel", ["outer", "inner", "none"])
def test_every_schedule_takes_the_same_step_in_a_pte(one_layer_program_factory, one_layer_model_dir, parallel):
    """A program of each schedule and the eager ``both`` step, from the same B on the same batch and seed: one
    mathematics, so they differ only by float32 rounding (the eager schedules: tests/shared/test_zo.py).

    The schedule is the graph's grouping of its 2q paths, which the lowering does not touch: these programs run on
    the portable kernels, a third of an XNNPACK export (one delegate per base linear of every pass); XNNPACK's
    lowering of the step is the ``both`` programs' subject above. q = 2: each schedule already groups its paths
    its own way, and ``none`` unrolls 2q passes. The model has one layer (``one_layer_model_dir``): the grouping is
    the same in every layer. Rows are 3 columns, the narrowest a program takes, so the width is fixed: a symbolic
    width costs an export half again (docs/benchmarks/export_time.md) and the grouping does not see it (padded rows
    of every width are the ``both`` programs' subject above)."""
    update = {"q": 2, "batch_size": 4, "seq_len": 3, "parallel": parallel, "backend": "portable"}
    cfg = TINY_Q4.model_copy(update=update)
    assert cfg.widths is None
    pte, manifest = one_layer_program_factory(cfg)
    assert manifest.config.parallel == parallel
    eager = _eager(one_layer_model_dir, cfg.model_copy(update={"parallel": "both"}))
    assert eager.model.config.num_hidden_layers == 1
    b0 = torch.randn(manifest.lora_size, generator=torch.Generator().manual_seed(5)) * 0.05
    batch = _batches(cfg, eager.model.config.vocab_size)[0]
    device = Device(manifest, pte.parent)
    device.set_b(b0)
    losses, g = device.step(batch, seed=3)
    with torch.no_grad():
        eager.lora_b.copy_(b0)
        args = (torch.tensor([3]), torch.tensor([LR]), torch.tensor([EPS]))
        ref_losses, ref_g = (t.clone() for t in eager(batch.input_ids, batch.attention_mask, batch.targets, *args))
    ref_b, b = eager.lora_b.clone(), device.b()
    loss_atol, g_atol, b_atol = step_atols(eager.model.config, torch.float32, float(ref_losses.abs().max()), EPS, LR)
    torch.testing.assert_close(losses, ref_losses, rtol=0, atol=loss_atol)
    torch.testing.assert_close(g, ref_g, rtol=0, atol=g_atol)
    # B also rounds once more in float32 where its entries are largest
    torch.testing.assert_close(b, ref_b, rtol=0, atol=b_atol + 4 * float(ref_b.abs().max()) * 2**-24)
    assert not torch.equal(b, b0)


def test_programs_of_different_q_and_rank_share_one_weights_file(programs):
    """The .ptd holds the base model alone: q, the objective and the LoRA layout (rank 2 against 4: the frozen A
    stays in each .pte) change the programs, not their weights file."""
    folder, by_q = programs
    (c1, m1), (c4, m4) = by_q[1], by_q[4]
    assert c1.rank != c4.rank
    assert m1.ptd == m4.ptd and m1.pte.sha256 != m4.pte.sha256
    every, float32 = weights_files(folder)
    assert float32 == {m1.ptd.file} and m1.ptd.file in every  # one weights file for the model's float32 programs
    assert m1.pte.size < 1_000_000 < m1.ptd.size * 1_000 and m1.ptd.size > m1.pte.size
    assert m1.lora != m4.lora and m1.tokenizer == m4.tokenizer


def test_the_weights_file_stores_each_content_once(programs):
    """Keys whose tensors are equal (a tied embedding under the lookup's and XNNPACK's keys, the layer norms'
    ones) name one segment: the .ptd holds every distinct frozen tensor once."""
    from executorch.exir._serialize._cord import Cord
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorSerializer

    from shared.ptd import ptd_contents

    folder, by_q = programs
    data = (folder / by_q[1][1].ptd.file).read_bytes()
    buffers = [bytes(b) for b in FlatTensorSerializer().deserialize(Cord(data)).buffers]
    assert len(set(buffers)) == len(buffers), "two segments hold the same bytes"
    contents = ptd_contents(data)
    assert len({segment for segment, _ in contents.values()}) == len(buffers) < len(contents)


def test_the_memory_estimate_is_read_from_the_emitted_program(programs):
    """The manifest's ``memory_mb``: the files, XNNPACK's packed copy of the weights and the memory plan of the
    methods a training session loads, as the ``.pte`` itself states them (not a formula of the model's shapes)."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    folder, by_q = programs
    for _, manifest in by_q.values():
        pte = deserialize_pte_binary((folder / manifest.pte.file).read_bytes())
        plans = {p.name: sum(p.non_const_buffer_sizes) for p in getattr(pte, "program", pte).execution_plan}
        training = sum(size for name, size in plans.items() if name != "evaluate")
        assert 0 < plans["evaluate"] < training
        total = manifest.pte.size + 2 * manifest.ptd.size + training
        assert manifest.memory_mb == int(total / 2**20) + 1


def test_set_then_get_round_trips(programs):
    folder, by_q = programs
    device = Device(by_q[1][1], folder)
    b = torch.randn(by_q[1][1].lora_size)
    device.set_b(b)
    assert torch.equal(device.b(), b)


def test_program_started_from_an_adapter_continues_from_it(programs, tiny_model_dir, tmp_path):
    """``start_from_adapter`` (what ``export --adapter`` ends with) puts a previous adapter's B beside a program; the
    device starts from it and takes the eager step from that B. The ``.pte`` is the very same: B is a buffer."""
    folder, by_q = programs
    cfg, fresh = by_q[1]
    eager = _eager(tiny_model_dir, cfg)
    previous = torch.randn(eager.lora.size, generator=torch.Generator().manual_seed(3)) * 0.05
    save_lora(tmp_path / "previous", eager.lora, previous, str(tiny_model_dir))
    pte = tmp_path / fresh.pte.file
    shutil.copyfile(folder / fresh.pte.file, pte)
    manifest_path(pte).write_bytes(fresh.to_json())
    manifest = start_from_adapter(pte, tmp_path / "previous")
    assert manifest == read_manifest(pte) and manifest.pte == fresh.pte and fresh.init_b is None
    init_b = torch.from_numpy(read_b_file(tmp_path / manifest.init_b.file, manifest.lora_size))
    assert torch.equal(init_b, previous)
    other = build_step_module(load_model(tiny_model_dir, "float32")[0], cfg.model_copy(update={"rank": 3})).lora
    assert cfg.rank != 3
    save_lora(tmp_path / "rank3", other, other.zeros(), str(tiny_model_dir))
    with pytest.raises(UsageError, match="rank/targets 3/"):
        start_from_adapter(pte, tmp_path / "rank3")
    device = Device(manifest, tmp_path, store=folder)
    device.set_b(init_b)
    assert torch.equal(device.b(), previous)
    batch = _batches(cfg, eager.model.config.vocab_size)[0]
    with torch.no_grad():
        eager.lora_b.copy_(previous)
        expected, _ = eager(
            batch.input_ids,
            batch.attention_mask,
            batch.targets,
            torch.tensor([0]),
            torch.tensor([LR]),
            torch.tensor([EPS]),
        )
    losses, _ = device.step(batch, seed=0)
    assert_same_step_losses(losses, expected, eager.model.config)


def test_a_classification_programs_evaluate_scores_every_candidate_in_one_pass(programs, tiny_model_dir):
    """The q = 4 program trains SST-2 as classification: its ``evaluate`` returns each row's candidates'
    log-likelihoods (eager ``candidate_scores``, within float32 rounding), and their cross-entropy at the row's answer
    is the loss the step trains on (eager ``forward_losses`` with the master B)."""
    from shared.batch import Batch
    from shared.zo import candidate_scores, forward_losses

    folder, by_q = programs
    cfg, manifest = by_q[4]
    assert cfg.objective == "classification" and manifest.config.candidates == cfg.candidates
    device, eager = Device(manifest, folder), _eager(tiny_model_dir, cfg)
    b = torch.randn(manifest.lora_size, generator=torch.Generator().manual_seed(8)) * 0.05
    device.set_b(b)
    batch = _batches(cfg, eager.model.config.vocab_size)[0]
    scores = device.methods["evaluate"].execute([batch.input_ids, batch.attention_mask, batch.targets])[0]
    assert scores.shape == (cfg.batch_size, len(cfg.candidates))
    with torch.no_grad():
        eager.lora.apply(b[None])
        want = candidate_scores(eager.model, batch)
        losses = forward_losses(eager.model, Batch(**{**batch.__dict__, "candidates": torch.tensor(cfg.candidates)}))
        eager.lora.apply(None)
    assert_same_step_losses(scores, want, eager.model.config)
    labels = torch.tensor([cfg.candidates.index(int(t)) for t in batch.targets[:, -1]])
    from_scores = torch.logsumexp(scores, 1) - scores.gather(1, labels[:, None])[:, 0]
    assert_same_step_losses(from_scores, losses, eager.model.config)


def test_a_batch_runs_at_its_longest_row(programs, tiny_model_dir):
    """A program takes any number of columns in its manifest's ``inputs.widths``, so the device runs each batch at
    its longest row (``fit_width``) rather than at ``seq_len``: the step's losses and ``evaluate``'s scores are the
    full-width eager ones within float32 rounding (the columns cut are padding in every row)."""
    import numpy as np

    from device_agent.batches import StepBatch, fit_width
    from device_agent.et_program import ProgramSession
    from shared.zo import candidate_scores

    folder, by_q = programs
    cfg, manifest = by_q[4]
    assert manifest.inputs.widths == cfg.widths == (3, cfg.seq_len)
    session = ProgramSession(folder / manifest.pte.file, folder / manifest.ptd.file, widths=manifest.inputs.widths)
    eager = _eager(tiny_model_dir, cfg)
    b = torch.randn(manifest.lora_size, generator=torch.Generator().manual_seed(3)) * 0.05
    lr, vocab = float(np.float32(LR)), eager.model.config.vocab_size
    for k, longest in enumerate((3, 7, 12)):
        short = random_batch(cfg.batch_size, 50 + k, longest, cfg.answer_len, vocab, cfg.candidates)
        full = [torch.nn.functional.pad(t, (cfg.seq_len - longest, 0)) for t in (short.input_ids, short.attention_mask)]
        ids, mask = (t.numpy() for t in full)
        assert fit_width(ids, mask, manifest.inputs.widths)[0].shape[1] <= longest < cfg.seq_len
        session.set_b(b.numpy())
        losses, _ = session.step(StepBatch(k, lr, ids, mask, short.targets.numpy()), lr, EPS)
        session.set_b(b.numpy())  # the step moved B
        scores = session.evaluate(ids, mask, short.targets.numpy())
        with torch.no_grad():
            eager.lora_b.copy_(b)
            args = (torch.tensor([k]), torch.tensor([LR]), torch.tensor([EPS]))
            want, _ = eager(*full, short.targets, *args)
            eager.lora.apply(b[None])
            want_scores = candidate_scores(eager.model, eager._batch(*full, short.targets))
            eager.lora.apply(None)
        assert_same_step_losses(torch.from_numpy(losses), want, eager.model.config)
        assert_same_step_losses(torch.from_numpy(scores), want_scores, eager.model.config)


def test_the_step_modules_own_buffers_stay_out_of_the_shared_weights(tiny_model_dir):
    """B, the optimizer's state, the candidates and a calibrated program's prior are the job's: none may be tagged
    for the model's shared .ptd (``shared.lowering.is_frozen_weight``), or two jobs' programs would need two .ptd."""
    from types import SimpleNamespace

    from shared.lowering import is_frozen_weight

    cfg = TINY_Q4.model_copy(update={"optimizer": "momentum", "prior": (-0.5, -1.0)})
    module = _eager(tiny_model_dir, cfg)
    own = [name for name, _ in module.named_buffers() if not name.startswith("model.")]
    assert {"lora_b", "candidate_ids", "candidate_prior", "opt_state"} <= set(own)
    for name in own:  # as torch.export names a lifted buffer's placeholder
        node = SimpleNamespace(op="placeholder", name="b_" + name.replace(".", "_"), target=name)
        assert not is_frozen_weight(node), name
    weight = SimpleNamespace(op="placeholder", name="p_model_model_layers_0_mlp_up_proj_weight", target="w")
    assert is_frozen_weight(weight)
