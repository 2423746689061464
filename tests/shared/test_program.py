"""The device program: the .pte trains exactly like the eager step module, replays bit-exactly, shares weights."""

from pathlib import Path

import pytest
import torch

from shared.adapter import save_lora
from shared.hf_models import load_model
from shared.manifest import ProgramManifest
from shared.program import build_step_module, export_program
from shared.replay import replay
from shared.train_log import log_record
from tests.utils.programs import TINY_Q1, TINY_Q4
from tests.utils.tiny import random_batch
from tests.utils.tolerance import b_drift, loss_rtol

SEQ, ANSWER, STEPS, LR, EPS = TINY_Q1.seq_len, TINY_Q1.answer_len, 20, 0.2, 1e-2


def assert_same_step_losses(got: torch.Tensor, want: torch.Tensor, config) -> None:
    """The .pte (XNNPACK kernels) and eager ATen from the same B: within the float32 rounding bound of a loss."""
    atol = loss_rtol(config) * float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=0, atol=atol)


def _batches(q: int, e: int, vocab: int):
    return [random_batch(q * e, seed=1000 + k, max_len=SEQ, answer_len=ANSWER, vocab=vocab) for k in range(STEPS)]


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
    vocab = eager.model.config.vocab_size
    log = []
    for k, batch in enumerate(_batches(q, 2, vocab)):
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


def test_free_running_eager_training_tracks_the_program(programs, tiny_model_dir):
    """Each on its own B for 20 steps: the B's differ only by what their g's differ by (the update rule is one)."""
    folder, by_q = programs
    cfg, manifest = by_q[4]
    device, eager = Device(manifest, folder), _eager(tiny_model_dir, cfg)
    device.set_b(torch.zeros(manifest.lora_size))
    g_device, g_eager = [], []
    with torch.no_grad():
        for k, batch in enumerate(_batches(4, 2, eager.model.config.vocab_size)):
            g_device.append(device.step(batch, seed=k)[1])
            args = (torch.tensor([k]), torch.tensor([LR]), torch.tensor([EPS]))
            g_eager.append(eager(batch.input_ids, batch.attention_mask, batch.targets, *args)[1].clone())
    drift = b_drift(g_device, g_eager, LR)[-1]
    assert eager.lora_b.abs().max() > 10 * drift  # the bound says something about B
    torch.testing.assert_close(device.b(), eager.lora_b, rtol=0, atol=drift)


def test_programs_of_different_q_share_one_weights_file(programs):
    folder, by_q = programs
    (_, m1), (_, m4) = by_q[1], by_q[4]
    assert m1.ptd == m4.ptd and m1.pte.sha256 != m4.pte.sha256
    assert sorted(p.name for p in folder.glob("*.ptd")) == [m1.ptd.file]
    assert m1.pte.size < 1_000_000 < m1.ptd.size * 1_000 and m1.ptd.size > m1.pte.size
    assert m1.lora == m4.lora and m1.tokenizer == m4.tokenizer


def test_set_then_get_round_trips(programs):
    folder, by_q = programs
    device = Device(by_q[1][1], folder)
    b = torch.randn(by_q[1][1].lora_size)
    device.set_b(b)
    assert torch.equal(device.b(), b)


def test_program_started_from_an_adapter_continues_from_it(programs, tiny_model_dir, tmp_path):
    folder, by_q = programs
    cfg, _ = by_q[1]
    eager = _eager(tiny_model_dir, cfg)
    previous = torch.randn(eager.lora.size, generator=torch.Generator().manual_seed(3)) * 0.05
    save_lora(tmp_path / "previous", eager.lora, previous, str(tiny_model_dir))
    manifest = export_program(
        tiny_model_dir,
        cfg,
        tmp_path / "cont.pte",
        store=folder,
        init_adapter=tmp_path / "previous",
        progress=lambda _: None,
    )
    assert manifest.ptd == by_q[1][1].ptd  # same base weights file, reused
    device = Device(manifest, tmp_path, store=folder)
    assert torch.equal(device.b(), previous)
    batch = _batches(1, 2, eager.model.config.vocab_size)[0]
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
