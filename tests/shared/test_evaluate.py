"""Candidate scoring on a tiny random Llama against an unpadded hand computation, and the ``mobizo eval`` command."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from mobizo.cli import main
from shared.data import encode, load_examples
from shared.evaluate import evaluate
from shared.tasks import Rendered, get_task, task_data_dir
from tests.shared.test_data import bpe_tokenizer
from tests.utils.tolerance import loss_rtol

pytestmark = pytest.mark.numerics  # CI runs these again on ATen's portable kernels (.ci/run)

DATA = task_data_dir()


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return bpe_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def hand_nll(model: LlamaForCausalLM, prompt_ids: list[int], answer_ids: list[int]) -> tuple[float, int]:
    """Summed NLL of the answer after the prompt: one unpadded row, no mask, default positions."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt_ids + answer_ids])).logits[0]
    logp = logits.log_softmax(dim=-1)[len(prompt_ids) - 1 : -1]
    return -logp.gather(1, torch.tensor(answer_ids)[:, None]).sum().item(), len(answer_ids)


def hand_metrics(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, rendered: list[Rendered]) -> dict:
    """Accuracy and both objectives' losses, one unpadded row per (example, candidate)."""
    hits, nll, tokens, cross_entropy = 0, 0.0, 0, 0.0
    for example in encode(rendered, tokenizer):
        scores = [hand_nll(model, example.prompt_ids, answer) for answer in example.candidate_ids]
        means = [-s / n for s, n in scores]
        hits += max(range(len(means)), key=means.__getitem__) == example.label
        nll, tokens = nll + scores[example.label][0], tokens + scores[example.label][1]
        cross_entropy -= torch.log_softmax(torch.tensor(means, dtype=torch.float64), 0)[example.label].item()
    n = len(rendered)
    return {"accuracy": hits / n, "lm": nll / tokens, "classification": cross_entropy / n, "n": n}


@pytest.mark.parametrize(
    ("task", "path"), [("copa", "superglue/copa/train32.jsonl"), ("sst2", "sst2/validation.jsonl")]
)
@pytest.mark.parametrize("batch_size", [1, 5, 64])
def test_evaluate_matches_unpadded_hand_scores(model, tokenizer, task: str, path: str, batch_size: int) -> None:
    """Left padding and masks leave every candidate's score as if its row were alone; mean, not summed,
    log-likelihood picks the answer (COPA's choices differ in length). Llama's RoPE only sees relative positions,
    so this cannot check position_ids; test_data checks those."""
    rendered = load_examples(get_task(task), DATA / path, limit=24)
    expected = hand_metrics(model, tokenizer, rendered)
    assert 0.0 < expected["accuracy"] < 1.0  # the random model is not trivially right or wrong
    objectives = ["lm", "classification"] if task == "sst2" else ["lm"]  # COPA's answers come from the data
    for objective in objectives:
        got = evaluate(model, tokenizer, get_task(task), rendered, batch_size=batch_size, objective=objective)
        assert got["n"] == expected["n"] and got["accuracy"] == expected["accuracy"]
        rtol = loss_rtol(model.config)  # other padding widths
        assert got["loss"] == pytest.approx(expected[objective], rel=rtol) and got["objective"] == objective
    default = evaluate(model, tokenizer, get_task(task), rendered, batch_size=batch_size)["objective"]
    assert default == objectives[-1]  # SST-2's answers are single tokens: classification, COPA's lm


def test_one_pass_scores_every_single_token_candidate_as_its_own_row_does(model, tokenizer) -> None:
    """SST-2's candidates are single tokens: one row per example scores both, as two rows per example do."""
    from shared.evaluate import _score_all, _score_single_tokens

    encoded = encode(load_examples(get_task("sst2"), DATA / "sst2/validation.jsonl", limit=24), tokenizer)
    assert all(len(c) == 1 for e in encoded for c in e.candidate_ids)
    with torch.no_grad():
        one, one_count = _score_single_tokens(model, encoded, 0, 7, False)
        rows, rows_count = _score_all(model, encoded, 0, 7, False)
    assert one_count == rows_count
    torch.testing.assert_close(torch.tensor(one), torch.tensor(rows), rtol=loss_rtol(model.config), atol=0)
    assert [max(range(2), key=lambda c: -r[c]) for r in one] == [max(range(2), key=lambda c: -r[c]) for r in rows]


def test_lm_loss_of_an_example_alone_equals_its_share_in_a_padded_batch(model, tokenizer) -> None:
    task = get_task("lm")
    rendered = [
        Rendered("Dear Ann,", [" thanks for the tea."], 0),
        Rendered("it 's a charming and often affecting journey . It was", [" great"], 0),
        Rendered("", [" unflinchingly bleak and desperate"], 0),
    ]
    alone = [evaluate(model, tokenizer, task, [example]) for example in rendered]
    together = evaluate(model, tokenizer, task, rendered, batch_size=3)
    tokens = [len(e.candidate_ids[0]) for e in encode(rendered, tokenizer)]
    assert together["accuracy"] is None and together["n"] == 3
    expected = sum(m["loss"] * n for m, n in zip(alone, tokens, strict=True)) / sum(tokens)
    rtol = loss_rtol(model.config)  # other padding widths
    assert together["loss"] == pytest.approx(expected, rel=rtol)
    assert together["loss"] == pytest.approx(hand_metrics(model, tokenizer, rendered)["lm"], rel=rtol)


def test_evaluate_truncates_like_encode_and_restores_training_mode(model, tokenizer) -> None:
    rendered = load_examples(get_task("rte"), DATA / "rte/validation.jsonl", limit=6)
    model.train()
    try:
        cut = evaluate(model, tokenizer, get_task("rte"), rendered, max_len=24)
        assert model.training
    finally:
        model.eval()
    assert cut != evaluate(model, tokenizer, get_task("rte"), rendered)
    assert cut["n"] == 6


# --- mobizo eval -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(model, tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-eval")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def sst2_file(tmp_path: Path, lines: list[str] | None = None) -> Path:
    path = tmp_path / "sst2.jsonl"
    path.write_text("\n".join(lines or ['{"sentence": "a fine film", "label": 1}', '{"sentence": "dull", "label": 0}']))
    return path


def test_eval_command_prints_the_metrics(model, tokenizer, model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    data = DATA / "sst2/validation.jsonl"
    args = ["eval", "--model", str(model_dir), "--task", "sst2", "--data", str(data), "--limit", "12"]
    assert main([*args, "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    expected = evaluate(model, tokenizer, get_task("sst2"), load_examples(get_task("sst2"), data, limit=12))
    assert metrics["n"] == 12 and metrics["accuracy"] == expected["accuracy"]
    assert metrics["loss"] == pytest.approx(expected["loss"], rel=loss_rtol(model.config))
    assert main(args) == 0
    assert capsys.readouterr().out.startswith(f"sst2: accuracy {expected['accuracy']:.4f}")


def test_a_user_s_held_out_text_is_scored_token_by_token_with_its_perplexity(
    model, tokenizer, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The per-user text (``text``, the shipped Shakespeare sample's first user): the loss is the mean over every
    token of the held-out speeches, perplexity its exp, in ``mobizo eval`` and in the held-out figures a server
    keeps (which take the perplexity from the loss, whatever a device claims)."""
    from benchmarks.personal_data import jsonl, split
    from shared.schemas import HeldOut

    held_out = split()[0].held_out[:3]
    data = tmp_path / "held_out.jsonl"
    data.write_bytes(jsonl(held_out))
    rendered = load_examples(get_task("text"), data)
    assert len(rendered) > len(held_out)  # a row per line
    got = evaluate(model, tokenizer, get_task("text"), rendered, batch_size=8)
    assert got["loss"] == pytest.approx(hand_metrics(model, tokenizer, rendered)["lm"], rel=loss_rtol(model.config))
    assert got["accuracy"] is None and got["perplexity"] == math.exp(got["loss"])
    assert main(["eval", "--model", str(model_dir), "--task", "text", "--data", str(data)]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith(f"text: loss {got['loss']:.4f}, perplexity {got['perplexity']:.2f} on {len(rendered)}")
    entries = [{"step": 0, "accuracy": None, "loss": 2.5, "n": 9, "perplexity": 1.0}, {"step": 5, "loss": 2.0}]
    summary = HeldOut.from_metrics({"eval": entries}).model_dump(mode="json")
    assert summary["before"]["perplexity"] == math.exp(2.5) and "perplexity" not in summary["after"]


def test_eval_command_custom_task(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = ["eval", "--model", str(model_dir), "--task", "custom", "--data", str(sst2_file(tmp_path))]
    verbalizer = json.dumps({"0": " terrible", "1": " great"})
    assert main([*args, "--template", "{sentence} It was", "--verbalizer", verbalizer, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["n"] == 2


def test_eval_command_applies_the_adapter(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from shared.adapter import load_adapter, save_lora
    from shared.hf_models import load_model
    from shared.lora import inject_lora

    base, tokenizer = load_model(model_dir)
    lora = inject_lora(base, ("q_proj", "v_proj"), rank=4, alpha=8.0)
    torch.manual_seed(1)
    save_lora(tmp_path / "adapter", lora, torch.randn(lora.size), str(model_dir))
    data = DATA / "sst2/validation.jsonl"
    args = ["eval", "--model", str(model_dir), "--task", "sst2", "--data", str(data), "--limit", "12", "--json"]
    assert main([*args, "--adapter", str(tmp_path / "adapter")]) == 0
    got = json.loads(capsys.readouterr().out)
    rendered = load_examples(get_task("sst2"), data, limit=12)
    adapted, _ = load_model(model_dir)
    load_adapter(adapted, tmp_path / "adapter")
    rtol = loss_rtol(adapted.config)
    assert got["loss"] == pytest.approx(evaluate(adapted, tokenizer, get_task("sst2"), rendered)["loss"], rel=rtol)
    plain, _ = load_model(model_dir)
    # the adapter's effect must stand well clear of the rounding bound
    assert got["loss"] != pytest.approx(evaluate(plain, tokenizer, get_task("sst2"), rendered)["loss"], rel=10 * rtol)


@pytest.mark.parametrize(
    ("change", "argument"),
    [
        ({"--model": "missing-dir"}, "--model"),
        ({"--data": "missing.jsonl"}, "--data"),
        ({"--adapter": "missing-adapter"}, "--adapter"),
        ({"--task": "mnli"}, "--task"),
        ({"--limit": "0"}, "--limit"),
        ({"--batch-size": "0"}, "--batch-size"),
        ({"--task": "custom", "--template": "{sentence}", "--verbalizer": "{bad json"}, "--verbalizer"),
        ({"--template": "{sentence}"}, "--verbalizer"),  # another prompt for sst2 needs its answers too
        ({"--template": "{text}", "--verbalizer": '{"0": " no", "1": " yes"}'}, "--template"),  # no sst2 field
    ],
)
def test_eval_command_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture, change: dict, argument: str) -> None:
    """Bad arguments exit 2 naming the argument, before any model is loaded (the model dir here is empty)."""
    options = {"--model": str(tmp_path), "--task": "sst2", "--data": str(sst2_file(tmp_path)), **change}
    assert main(["eval", *[part for item in options.items() for part in item]]) == 2
    assert f"argument {argument}:" in capsys.readouterr().err


def test_eval_command_bad_data_line_exits_1(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data = sst2_file(tmp_path, ['{"sentence": "fine", "label": 1}', '{"sentence": "dull", "label": "bad"}'])
    assert main(["eval", "--model", str(model_dir), "--task", "sst2", "--data", str(data)]) == 1
    assert f"{data}:2: field 'label'" in capsys.readouterr().err
