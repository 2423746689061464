"""The inference program: the .pte's logits are eager PyTorch + PEFT's, greedy decoding agrees, adapters swap.

Reference: the Hugging Face model with the adapter applied by PEFT itself (not mobizo's LoRA layers), run on the
whole sequence at once; the program runs the same tokens through its KV cache.
"""

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from device_agent.inference import InferenceSession
from shared.adapter import save_program_adapter
from shared.generation import EagerStepper, Sampling, generate
from shared.hf_models import load_model
from tests.utils.programs import weights_files
from tests.utils.tolerance import loss_rtol

pytestmark = pytest.mark.numerics  # CI runs these again on ATen's portable kernels (.ci/run)

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def inference(tiny_inference):
    return tiny_inference


@pytest.fixture(scope="module")
def session(inference):
    pte, manifest, store, _ = inference
    return InferenceSession(pte, store / manifest.ptd.file, manifest)


@pytest.fixture(scope="module")
def adapters(inference, tmp_path_factory):
    """Two adapters of the program's layout with B large enough to move the logits well beyond the tolerance."""
    _, manifest, _, train_manifest = inference
    out = {}
    for name, seed in (("a", 1), ("b", 2)):
        b = torch.randn(manifest.lora_size, generator=torch.Generator().manual_seed(seed)) * 0.5
        out[name] = (save_program_adapter(tmp_path_factory.mktemp(name), train_manifest, b, "tiny"), b)
    return out


def _eager(model_dir: Path, adapter: Path | None):
    from peft import PeftModel

    model, _ = load_model(model_dir)
    return model if adapter is None else PeftModel.from_pretrained(model, adapter).eval()


def _logits_atol(model, logits: torch.Tensor) -> float:
    """Two evaluations of one logit differ by at most the model's float32 rounding bound (tests/utils/tolerance.py:
    (layers + 2) * n_max * u relative), times the size of the logits compared."""
    return loss_rtol(model.config) * float(logits.abs().max())


def _tokens(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def test_shares_the_training_programs_weights_file(inference):
    """One weights .ptd per model: the inference export wrote (and found) the training programs' very file."""
    _, manifest, store, train_manifest = inference
    assert manifest.ptd == train_manifest.ptd
    assert manifest.tokenizer == train_manifest.tokenizer
    assert manifest.lora == train_manifest.lora
    _, float32 = weights_files(store)
    assert float32 == {train_manifest.ptd.file}  # the inference program wrote no second file


@pytest.mark.parametrize("which", [None, "a"])
def test_teacher_forced_logits_equal_eager_peft(inference, session, adapters, tiny_model_dir, which):
    """Prefill of 24 tokens, then 16 one-token decode steps through the cache: every position's logits within the
    derived bound of PEFT's on the whole sequence; and an adapter moves them far beyond that bound."""
    adapter, b = adapters[which] if which else (None, None)
    eager = _eager(tiny_model_dir, adapter)
    ids = _tokens(40, eager.config.vocab_size)
    with torch.no_grad():
        want = eager(input_ids=ids).logits[0]
    session.set_b(None if b is None else b.numpy())
    got = [session.logits(ids[:, :24], torch.arange(24))[0]]
    got += [session.logits(ids[:, p : p + 1], torch.tensor([p]))[0] for p in range(24, 40)]
    got = torch.cat(got)
    atol = _logits_atol(eager, want)
    torch.testing.assert_close(got, want, rtol=0, atol=atol)
    if which:
        base = _eager(tiny_model_dir, None)
        with torch.no_grad():
            assert float((base(input_ids=ids).logits[0] - want).abs().max()) > 100 * atol


@pytest.mark.parametrize("which", [None, "a"])
def test_greedy_decoding_agrees_where_eager_is_decisive(session, adapters, tiny_model_dir, which):
    """32 greedy tokens: the program picks eager's token at every step whose top-2 margin exceeds twice the bound
    (each side may be off by the bound); the first closer call may flip, after which the texts may differ."""
    adapter, b = adapters[which] if which else (None, None)
    eager = _eager(tiny_model_dir, adapter)
    prompt = _tokens(8, eager.config.vocab_size, seed=3)[0].tolist()
    session.set_b(None if b is None else b.numpy())
    device = [g.token for g in generate(session, prompt, NEW_TOKENS, Sampling())]
    stepper, margins, bounds = EagerStepper(eager), [], []

    def recording(tokens, pos):
        logits = stepper(tokens, pos)
        top2 = torch.topk(logits, 2).values
        margins.append(float(top2[0] - top2[1]))
        bounds.append(2 * _logits_atol(eager, logits))
        return logits

    reference = [g.token for g in generate(recording, prompt, NEW_TOKENS, Sampling())]
    compared = 0
    for mine, theirs, margin, bound in zip(device, reference, margins, bounds, strict=True):
        if margin <= bound:
            break
        assert mine == theirs
        compared += 1
    assert compared >= 8, f"only {compared} decisive steps: the test compares too little"


def test_adapter_swap_restores_logits_exactly_without_reloading(inference, session, adapters):
    """A → B → A on one loaded program: A's logits again, bit for bit; B's differ; the program was loaded once."""
    loads = InferenceSession.loads
    ids = _tokens(16, inference[1].vocab_size, seed=5)
    results = []
    for name in ("a", "b", "a"):
        session.set_b(adapters[name][1].numpy())
        results.append(session.logits(ids, torch.arange(16)))
    assert torch.equal(results[0], results[2])
    assert not torch.allclose(results[0], results[1])
    assert InferenceSession.loads == loads


def test_the_kv_cache_is_planned_not_stored_and_set_lora_b_empties_it(inference, session, adapters, tiny_model_dir):
    """The .pte is smaller than the cache it would hold if its zeros were stored; after ``set_lora_b`` the cache is
    empty: positions 8-15 continued after a fresh set see zeros where the prefill's keys and values were."""
    pte, manifest, _, _ = inference
    config = AutoConfig.from_pretrained(tiny_model_dir)
    head_dim = config.hidden_size // config.num_attention_heads
    cache_bytes = config.num_hidden_layers * 2 * config.num_key_value_heads * manifest.config.max_context * head_dim * 4
    assert pte.stat().st_size < cache_bytes, (pte.stat().st_size, cache_bytes)
    ids, b = _tokens(16, manifest.vocab_size, seed=7), adapters["a"][1].numpy()
    session.set_b(b)
    whole = session.logits(ids, torch.arange(16))[0, 8:]
    continued = session.logits(ids[:, 8:], torch.arange(8, 16))[0]  # the cache holds positions 0-7
    atol = loss_rtol(config) * float(whole.abs().max())
    assert torch.allclose(continued, whole, rtol=0, atol=atol)
    session.set_b(b)
    emptied = session.logits(ids[:, 8:], torch.arange(8, 16))[0]  # positions 0-7 now zeros
    assert (emptied - whole).abs().max() > 100 * atol


def test_program_scores_a_task_as_eager_peft_does(session, adapters, tiny_model_dir):
    """``shared.evaluate`` through the program (``ProgramAsModel``, each row alone) and through eager PEFT on the
    padded batches: accuracy equal, loss within the model's rounding bound relative to the loss."""
    from device_agent.local_inference import ProgramAsModel
    from shared.data import load_examples
    from shared.evaluate import evaluate
    from shared.tasks import get_task, task_data_dir

    adapter, b = adapters["a"]
    eager = _eager(tiny_model_dir, adapter)
    _, tokenizer = load_model(tiny_model_dir)
    task = get_task("sst2")
    rendered = load_examples(task, task_data_dir() / "sst2" / "train.jsonl", 24)
    session.set_b(b.numpy())
    got = evaluate(ProgramAsModel(session), tokenizer, task, rendered, 8, session.max_context)
    want = evaluate(eager, tokenizer, task, rendered, 8, session.max_context)
    assert got["n"] == want["n"] == 24 and got["accuracy"] == want["accuracy"]
    assert abs(got["loss"] - want["loss"]) <= loss_rtol(eager.config) * want["loss"]
