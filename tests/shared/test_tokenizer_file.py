"""The device's tokenizer (``shared.tokenizer_file.FileTokenizer``: the ``tokenizers`` library alone) encodes the
device's data to the same ids as the model's Hugging Face tokenizer, which the server and ``mobizo train`` use."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.tokenizer_file import load_tokenizer_file, tokenizer_bytes

DATA = Path(__file__).resolve().parents[2] / "data"


def _texts() -> list[str]:
    rows = [json.loads(line) for line in (DATA / "sst2" / "train.jsonl").read_text().splitlines()[:200]]
    texts = [row["sentence"] for row in rows]
    # What prompts look like: a template around the text, answers after it, unicode, leading spaces, empty text
    return (
        texts + [f"Review: {t}\nSentiment: positive" for t in texts[:20]] + ["", " a", "naïve café — ünïcode", "\n\n"]
    )


def _same_ids(hf_tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_bytes(tokenizer_bytes(hf_tokenizer))
    device = load_tokenizer_file(path)
    texts = _texts()
    for special in (False, True):
        want = hf_tokenizer(texts, add_special_tokens=special)["input_ids"]
        assert device(texts, add_special_tokens=special)["input_ids"] == want
        assert [device(t, add_special_tokens=special)["input_ids"] for t in texts[:10]] == want[:10]
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(device, name) == getattr(hf_tokenizer, name), name
    ids = hf_tokenizer(texts[:5], add_special_tokens=True)["input_ids"]
    for row in ids:
        assert device.decode(row, skip_special_tokens=True) == hf_tokenizer.decode(row, skip_special_tokens=True)


def test_the_device_tokenizer_encodes_as_the_tiny_models(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    _same_ids(AutoTokenizer.from_pretrained(tiny_model_dir), tmp_path)


@pytest.mark.slow
def test_the_device_tokenizer_encodes_as_smollm2s(smollm2_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    _same_ids(AutoTokenizer.from_pretrained(smollm2_dir), tmp_path)


def test_a_damaged_tokenizer_file_is_a_clear_error(tmp_path: Path) -> None:
    from shared.errors import MobizoError

    path = tmp_path / "tokenizer.json"
    path.write_text('{"special_tokens": {}}')
    with pytest.raises(MobizoError, match="cannot read tokenizer file"):
        load_tokenizer_file(path)
