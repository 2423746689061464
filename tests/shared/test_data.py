"""JSONL reading, encoding with left truncation, left-padded batches, and the deterministic batch order."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from shared.batch import IGNORE_INDEX
from shared.data import (
    Encoded,
    answer_len,
    answer_len_for,
    batch_indices,
    encode,
    load_examples,
    load_records_rows,
    read_jsonl,
    training_batch,
)
from shared.errors import DataError, UsageError
from shared.tasks import Rendered, get_task

pytestmark = pytest.mark.numerics  # CI runs these again on ATen's portable kernels (.ci/run)

SPECIALS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2
CORPUS = [
    "it 's a charming and often affecting journey . It was great",
    "unflinchingly bleak and desperate It was terrible",
    'Does this mean that "the hypothesis" is true? Yes or No?\nYes\nNo\n',
    "The man turned on the faucet so water flowed from the spout because the toilet filled with water.",
] * 20


def bpe_tokenizer(add_bos: bool = True, vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2 style, like SmolLM2's) trained in-process; optionally adds <s> like Llama's."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def dummy_prefix_tokenizer() -> PreTrainedTokenizerFast:
    """SentencePiece-Llama behaviour: every text gets a leading "▁", so " great" alone reads "▁", "▁great"."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=SPECIALS, initial_alphabet=sorted(set("".join(CORPUS).replace(" ", "▁")))
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return bpe_tokenizer()


def write(tmp_path: Path, text: str | bytes, name: str = "data.jsonl") -> Path:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


# --- read_jsonl / load_examples -------------------------------------------------------------------------------


def test_read_jsonl_skips_blank_lines(tmp_path: Path) -> None:
    path = write(tmp_path, '{"a": 1}\n\n  \n{"a": 2}\n')
    assert read_jsonl(path) == [{"a": 1}, {"a": 2}]


@pytest.mark.parametrize(
    ("text", "line", "reason"),
    [
        ('{"a": 1}\n{"a": 2}\n{"a": \n', 3, "invalid JSON"),
        ('{"a": 1}\n[1, 2]\n', 2, "expected a JSON object, got list"),
        ('"text"\n', 1, "expected a JSON object, got str"),
        (b'{"a": 1}\n{"a": "\xff"}\n', 2, "not valid UTF-8"),
    ],
)
def test_read_jsonl_names_file_and_line(tmp_path: Path, text: str | bytes, line: int, reason: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(DataError, match="^" + re.escape(f"{path}:{line}: {reason}")):
        read_jsonl(path)


@pytest.mark.parametrize("text", ["", "\n\n"])
def test_read_jsonl_empty_file_is_an_error(tmp_path: Path, text: str) -> None:
    with pytest.raises(DataError, match="no examples"):
        read_jsonl(write(tmp_path, text))


def test_read_jsonl_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="cannot read"):
        read_jsonl(tmp_path / "nope.jsonl")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"sentence": "ok", "label": 1}\n{"label": 0}\n', ":2: missing field 'sentence'"),
        ('{"sentence": "ok", "label": 7}\n', ":1: field 'label': 7 is not one of 0, 1"),
        ('{"sentence": null, "label": 1}\n', ":1: field 'sentence' must be a string"),
    ],
)
def test_load_examples_names_line_and_field(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(DataError, match="^" + re.escape(f"{path}{message}")):
        load_examples(get_task("sst2"), path)


def test_load_examples_limit_takes_the_first_but_checks_all(tmp_path: Path) -> None:
    lines = [f'{{"sentence": "s{i}", "label": {i % 2}}}' for i in range(5)]
    rendered = load_examples(get_task("sst2"), write(tmp_path, "\n".join(lines)), limit=2)
    assert [r.prompt for r in rendered] == ["s0 It was", "s1 It was"]
    with pytest.raises(DataError, match=":6:"):
        load_examples(get_task("sst2"), write(tmp_path, "\n".join([*lines, "{oops"])), limit=2)


def test_text_records_load_as_their_rows_record_by_record(tmp_path: Path) -> None:
    lines = ['{"text": "a\\nb", "context": "c"}', '{"text": "d"}']
    path = write(tmp_path, "\n".join(lines))
    grouped = load_records_rows(get_task("text"), path)
    assert [[r.candidates[0] for r in rows] for rows in grouped] == [["a\n", "b\n"], ["d\n"]]
    assert load_examples(get_task("text"), path) == [row for rows in grouped for row in rows]
    assert load_examples(get_task("text"), path, limit=2) == grouped[0]
    with pytest.raises(DataError, match="^" + re.escape(f"{path}:3: field 'text' is empty")):
        load_records_rows(get_task("text"), write(tmp_path, "\n".join([*lines, '{"text": ""}'])))


# --- encode ----------------------------------------------------------------------------------------------------


def test_encode_adds_bos_only_to_the_prompt_when_the_tokenizer_does() -> None:
    example = Rendered("it was", [" great", " terrible"], 1)
    for tok, bos in ((bpe_tokenizer(add_bos=True), [1]), (bpe_tokenizer(add_bos=False), [])):
        (enc,) = encode([example], tok)
        plain = tok("it was", add_special_tokens=False)["input_ids"]
        assert enc.prompt_ids == bos + plain
        assert enc.candidate_ids == [tok(c, add_special_tokens=False)["input_ids"] for c in example.candidates]
        assert enc.label == 1


def test_encode_tokenizes_candidates_as_they_follow_the_prompt() -> None:
    """With a dummy-prefix tokenizer, " great" on its own starts with a lone "▁" that never follows a prompt."""
    tok = dummy_prefix_tokenizer()
    (enc,) = encode([Rendered("It was", [" great", " terrible"], 0)], tok)
    for candidate, ids in zip([" great", " terrible"], enc.candidate_ids, strict=True):
        assert enc.prompt_ids + ids == tok("It was" + candidate, add_special_tokens=False)["input_ids"]
        assert ids != tok(candidate, add_special_tokens=False)["input_ids"]


def test_encode_cuts_the_prompt_from_the_left(tokenizer: PreTrainedTokenizerFast) -> None:
    example = Rendered("unflinchingly bleak and desperate journey . It was", [" great", " terrible and bleak"], 0)
    (full,) = encode([example], tokenizer)
    longest = max(map(len, full.candidate_ids))
    for max_len in (longest + 1, longest + 3, len(full.prompt_ids) + longest):
        (cut,) = encode([example], tokenizer, max_len=max_len)
        assert len(cut.prompt_ids) + longest == max_len
        assert cut.prompt_ids[0] == 1  # BOS stays first
        kept = len(cut.prompt_ids) - 1
        assert cut.prompt_ids[1:] == full.prompt_ids[len(full.prompt_ids) - kept :]  # the end of the prompt
        assert cut.candidate_ids == full.candidate_ids
    (short,) = encode([example], tokenizer, max_len=1000)
    assert short == full


def test_encode_rejects_an_answer_that_cannot_fit(tokenizer: PreTrainedTokenizerFast) -> None:
    example = Rendered("It was", [" great", " terrible and bleak"], 0)
    (full,) = encode([example], tokenizer)
    with pytest.raises(DataError, match="example 0: an answer of"):
        encode([example], tokenizer, max_len=max(map(len, full.candidate_ids)))  # no room even for BOS


def test_encode_needs_something_before_the_answer() -> None:
    with pytest.raises(DataError, match="empty prompt and no BOS"):
        encode([Rendered("", ["hello"], 0)], bpe_tokenizer(add_bos=False))
    (enc,) = encode([Rendered("", ["hello"], 0)], bpe_tokenizer(add_bos=True))
    assert enc.prompt_ids == [1]


# --- training_batch --------------------------------------------------------------------------------------------

EXAMPLES = [
    Encoded([5, 6, 7, 8, 9], [[10], [11, 12]], 1),
    Encoded([5], [[13, 14, 15], [16]], 0),
    Encoded([5, 6], [[17], [18]], 0),
]


def test_training_batch_layout() -> None:
    batch = training_batch(EXAMPLES, pad_id=0)
    torch.testing.assert_close(
        batch.input_ids, torch.tensor([[5, 6, 7, 8, 9, 11, 12], [0, 0, 0, 5, 13, 14, 15], [0, 0, 0, 0, 5, 6, 17]])
    )
    torch.testing.assert_close(batch.attention_mask, (batch.input_ids != 0).long())
    torch.testing.assert_close(
        batch.position_ids, torch.tensor([[0, 1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 1, 2, 3], [0, 0, 0, 0, 0, 1, 2]])
    )
    torch.testing.assert_close(batch.targets, torch.tensor([[IGNORE_INDEX, 11, 12], [13, 14, 15], [-100, -100, 17]]))
    assert answer_len(EXAMPLES) == 3
    for tensor in (batch.input_ids, batch.attention_mask, batch.position_ids, batch.targets):
        assert tensor.dtype == torch.long


@pytest.mark.parametrize(("seq_len", "answer_cols"), [(None, None), (12, None), (None, 5), (9, 4)])
def test_padded_rows_equal_the_unpadded_row(seq_len: int | None, answer_cols: int | None) -> None:
    """Whatever the padding, a row's real tokens, positions and targets are those of the row alone."""
    batch = training_batch(EXAMPLES, pad_id=3, seq_len=seq_len, answer_len=answer_cols)
    width, cols = batch.input_ids.shape[1], batch.targets.shape[1]
    assert width == (seq_len or 7) and cols == (answer_cols or 3)
    for i, example in enumerate(EXAMPLES):
        alone = training_batch([example], pad_id=3)
        n, a = alone.input_ids.shape[1], alone.targets.shape[1]
        assert batch.attention_mask[i].sum() == n
        torch.testing.assert_close(batch.input_ids[i, width - n :], alone.input_ids[0])
        torch.testing.assert_close(batch.position_ids[i, width - n :], torch.arange(n))
        torch.testing.assert_close(batch.targets[i, cols - a :], alone.targets[0])
        assert (batch.targets[i, : cols - a] == IGNORE_INDEX).all()
        # the contract: targets[:, j] is the token at column T - L + j
        answer_cols_ids = batch.input_ids[i, width - cols :]
        real = batch.targets[i] != IGNORE_INDEX
        torch.testing.assert_close(answer_cols_ids[real], batch.targets[i][real])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"seq_len": 6}, "example 0: 7 tokens do not fit in seq_len 6"),
        ({"answer_len": 2}, "example 1: answer of 3 tokens is longer than answer_len 2"),
        ({"seq_len": 4, "answer_len": 4}, "seq_len 4 leaves no column"),
    ],
)
def test_training_batch_refuses_rows_that_do_not_fit(kwargs: dict, message: str) -> None:
    with pytest.raises(DataError, match=message):
        training_batch(EXAMPLES, pad_id=0, **kwargs)


def test_training_batch_refuses_a_row_without_prompt() -> None:
    with pytest.raises(DataError, match="at least one prompt token"):
        training_batch([Encoded([], [[4]], 0)], pad_id=0)


# --- batch_indices ---------------------------------------------------------------------------------------------


def test_batch_indices_follow_seeded_epoch_permutations() -> None:
    n, size, seed = 10, 4, 7
    walk = np.concatenate([np.random.Generator(np.random.PCG64(seed + e)).permutation(n) for e in range(3)])
    for step in range(7):
        assert batch_indices(n, size, seed, step) == walk[step * size : (step + 1) * size].tolist()


def test_batch_indices_do_not_depend_on_history() -> None:
    first = batch_indices(100, 8, seed=3, step=41)
    for step in range(41):
        batch_indices(100, 8, seed=3, step=step)
    batch_indices(57, 8, seed=3, step=41)  # another data set in between
    assert batch_indices(100, 8, seed=3, step=41) == first
    assert batch_indices(100, 8, seed=4, step=41) != first


def test_each_epoch_visits_every_example_once() -> None:
    seen = [i for step in range(5) for i in batch_indices(20, 4, seed=0, step=step)]
    assert sorted(seen) == list(range(20))
    assert seen != list(range(20))  # shuffled


def test_length_buckets_deal_each_window_sorted_and_keep_the_walks_examples() -> None:
    """bucket B: each window of B batches holds the plain walk's examples of that window, dealt sorted by length
    (so a batch's lengths never overlap another's of its window but at ties), in a seeded order; bucket 1 is the
    plain walk; a batch then pads far less."""
    n, size, bucket, seed = 200, 8, 5, 3
    lengths = np.random.default_rng(1).integers(4, 60, size=n).tolist()
    ascending = []
    for window in range(6):  # windows straddle epoch boundaries too (200 is not a multiple of 40)
        steps = range(window * bucket, (window + 1) * bucket)
        dealt = [batch_indices(n, size, seed, k, lengths, bucket) for k in steps]
        plain = [i for k in steps for i in batch_indices(n, size, seed, k)]
        assert sorted(i for batch in dealt for i in batch) == sorted(plain)
        spans = sorted((min(lengths[i] for i in b), max(lengths[i] for i in b)) for b in dealt)
        assert all(low_next >= high for (_, high), (low_next, _) in zip(spans, spans[1:], strict=False))
        lows = [min(lengths[i] for i in b) for b in dealt]
        ascending.append(lows == sorted(lows))
    assert not all(ascending)  # a window's batches come in a shuffled order, not always shortest first
    assert batch_indices(n, size, seed, 7, lengths, 1) == batch_indices(n, size, seed, 7)
    widths = [[max(lengths[i] for i in batch_indices(n, size, seed, k, lengths, b)) for k in range(50)] for b in (1, 5)]
    assert np.mean(widths[1]) < 0.8 * np.mean(widths[0])
    with pytest.raises(ValueError, match="length"):
        batch_indices(n, size, seed, 0, None, bucket)


def test_batch_indices_reject_bad_arguments() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        batch_indices(10, 0, seed=0, step=0)


@pytest.mark.parametrize("make", [bpe_tokenizer, dummy_prefix_tokenizer])
def test_answer_len_for_counts_answer_tokens_after_the_prompt(make) -> None:
    tokenizer = make()
    task = get_task("custom", "{text} It was", {"neg": " terrible", "pos": " great", "meh": " so so so"})
    (encoded,) = encode([task.render({"text": "Fine.", "label": "pos"})], tokenizer)
    assert answer_len_for(task, tokenizer) == max(map(len, encoded.candidate_ids)) > 1
    assert answer_len_for(get_task("wsc"), tokenizer) == 1  # "No" / "Yes" after a newline
    with pytest.raises(UsageError, match="required for task copa") as info:
        answer_len_for(get_task("copa"), tokenizer)
    assert info.value.argument == "--answer-len"
