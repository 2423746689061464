"""Generation: the sampler, the eager KV-cache step, and `mobizo generate` from the command line."""

import json

import pytest
import torch

from mobizo.cli import main
from shared.errors import UsageError
from shared.generation import EagerStepper, Sampling, generate, sample_next, summary
from shared.hf_models import load_model
from tests.utils.tolerance import loss_rtol

pytestmark = pytest.mark.numerics  # CI runs these again on ATen's portable kernels (.ci/run)


def _draws(logits, sampling, n=400):
    gen = torch.Generator().manual_seed(sampling.seed)
    return [sample_next(logits, sampling, gen) for _ in range(n)]


def test_greedy_is_argmax_first_on_ties():
    assert sample_next(torch.tensor([0.1, 2.0, 2.0, -1.0]), Sampling(), torch.Generator()) == 1


def test_top_p_keeps_the_smallest_set_reaching_p():
    """Probabilities 0.6, 0.3, 0.1: p = 0.5 keeps the first token only, p = 0.8 the first two, 1.0 all three."""
    logits = torch.tensor([0.6, 0.3, 0.1]).log()
    assert set(_draws(logits, Sampling(temperature=1.0, top_p=0.5))) == {0}
    assert set(_draws(logits, Sampling(temperature=1.0, top_p=0.8))) == {0, 1}
    assert set(_draws(logits, Sampling(temperature=1.0, top_p=1.0))) == {0, 1, 2}


def test_same_seed_same_draws_other_seed_other_draws():
    logits = torch.zeros(50)
    assert _draws(logits, Sampling(temperature=1.0, seed=7)) == _draws(logits, Sampling(temperature=1.0, seed=7))
    assert _draws(logits, Sampling(temperature=1.0, seed=7)) != _draws(logits, Sampling(temperature=1.0, seed=8))


@pytest.mark.parametrize("kwargs, field", [({"temperature": -1.0}, "--temperature"), ({"top_p": 0.0}, "--top-p")])
def test_bad_sampling_names_the_flag(kwargs, field):
    with pytest.raises(UsageError, match=field):
        Sampling(**kwargs)


def test_eager_cache_steps_equal_the_whole_sequence(tiny_model_dir):
    """Prefill + one-token steps through the KV cache give the logits of one pass over the whole sequence, within
    the model's float32 rounding bound (tests/utils/tolerance.py) times the logits' size."""
    model, _ = load_model(tiny_model_dir)
    ids = torch.randint(3, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids).logits[0]
    stepper = EagerStepper(model)
    got = [stepper(ids[:, :12], torch.arange(12))] + [
        stepper(ids[:, p : p + 1], torch.tensor([p])) for p in range(12, 20)
    ]
    atol = loss_rtol(model.config) * float(want.abs().max())
    torch.testing.assert_close(torch.stack(got), want[11:], rtol=0, atol=atol)


def test_generate_stops_at_a_stop_token_and_at_the_context():
    def step(tokens, pos):
        return torch.nn.functional.one_hot(torch.tensor(int(pos[-1]) % 5), 5).float()

    assert [g.token for g in generate(step, [0], 10, Sampling(), stop_ids=frozenset({3}))] == [0, 1, 2, 3]
    assert len(list(generate(step, [0, 1], 10, Sampling(), max_context=6))) == 4
    with pytest.raises(UsageError, match="--prompt"):
        list(generate(step, [0] * 6, 1, Sampling(), max_context=6))
    assert summary(2, list(generate(step, [0, 1], 3, Sampling())))["new_tokens"] == 3


def test_cli_streams_json_lines_then_timings(tiny_model_dir, capsys):
    argv = ["generate", "--model", str(tiny_model_dir), "--prompt", "It was", "--max-new-tokens", "5", "--json"]
    assert main(argv + ["--temperature", "0.7", "--top-p", "0.9", "--seed", "3"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) <= 6 and lines[-1]["event"] == "done"
    assert [set(x) for x in lines[:-1]] == [{"token", "text", "seconds"}] * (len(lines) - 1)
    assert lines[-1]["new_tokens"] == len(lines) - 1 and lines[-1]["prefill_tokens_per_s"] > 0
    assert main(argv + ["--temperature", "0.7", "--top-p", "0.9", "--seed", "3"]) == 0
    assert [json.loads(x)["token"] for x in capsys.readouterr().out.splitlines()[:-1]] == [
        x["token"] for x in lines[:-1]
    ]


def test_cli_with_adapter_and_bad_arguments(tiny_model_dir, tmp_path, capsys):
    from peft import LoraConfig, get_peft_model

    model, _ = load_model(tiny_model_dir)
    peft_model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 1.0)
    peft_model.save_pretrained(tmp_path / "adapter")
    base = ["generate", "--model", str(tiny_model_dir), "--prompt", "It was", "--max-new-tokens", "6", "--json"]
    assert main(base + ["--adapter", str(tmp_path / "adapter")]) == 0
    printed = [json.loads(x)["token"] for x in capsys.readouterr().out.splitlines()[:-1]]
    from peft import PeftModel

    from shared.data import prompt_token_ids

    fresh, tokenizer = load_model(tiny_model_dir)
    adapted = PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
    ids = prompt_token_ids(tokenizer, "It was")
    want = [g.token for g in generate(EagerStepper(adapted), ids, 6, Sampling(), frozenset({tokenizer.eos_token_id}))]
    assert printed == want
    assert main(base + ["--top-p", "1.5"]) == 2 and "--top-p" in capsys.readouterr().err
    assert main(base + ["--adapter", str(tmp_path / "nope")]) == 2 and "--adapter" in capsys.readouterr().err
