"""The seeded tiny model and its tokenizer (shared/tiny_model.py) and ``mobizo make-tiny-model``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mobizo.cli import main
from shared.errors import MobizoError, UsageError
from shared.hf_models import count_params, load_model
from shared.tiny_model import make_tiny_model

TINY_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
ROUND_TRIP_TEXTS = [
    "a gripping , moving film .",
    "Über-café naïveté — «quoted» 日本語のテキスト 🙂👍🏽",
    "tabs\tand\nnewlines\r\n  and   spaces ",
    "\x00\x7f control bytes and <s> look-alikes </s>",
]


def file_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


# --- tiny model ---------------------------------------------------------------------------------------------


def test_tiny_model_writes_hugging_face_layout(tiny_model_dir: Path) -> None:
    assert TINY_FILES <= {p.name for p in tiny_model_dir.iterdir()}
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (2, 64, 512)
    assert config["max_position_embeddings"] >= 512
    assert not list(tiny_model_dir.parent.glob(".*tmp*")), "temporary folder left behind"


def test_tiny_model_loads_with_auto_classes(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    special = {tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}
    assert None not in special and len(special) == 3
    assert len(tokenizer) <= model.config.vocab_size
    ids = tokenizer("It was great", return_tensors="pt").input_ids
    assert ids[0, 0].item() == tokenizer.bos_token_id  # Llama convention: BOS in front
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 512) and torch.isfinite(logits).all()


def test_same_seed_gives_identical_files(tmp_path: Path) -> None:
    """Two builds in one process (one set of ATen kernels; the session's ``tiny_model_dir`` may come from the test
    cache, built under other kernels, whose ``normal_`` rounds differently)."""
    first, again = (make_tiny_model(tmp_path / name, seed=0) for name in ("first", "again"))
    assert file_bytes(again) == file_bytes(first)


def test_other_seed_changes_weights_not_tokenizer(tiny_model_dir: Path, tmp_path: Path) -> None:
    other = file_bytes(make_tiny_model(tmp_path / "other", seed=1))
    same = file_bytes(tiny_model_dir)
    assert other["model.safetensors"] != same["model.safetensors"]
    assert other["tokenizer.json"] == same["tokenizer.json"]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips_any_text(tiny_model_dir: Path, text: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text


@pytest.mark.parametrize("word", [" great", " terrible", " Yes", " No"])
def test_verbalizers_are_single_tokens(tiny_model_dir: Path, word: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(tokenizer(word, add_special_tokens=False).input_ids) == 1


def test_tokenizer_needs_the_task_data_and_says_where_it_looked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No silent fallback to other text: "same seed, same bytes" holds wherever the command runs, or it fails."""
    monkeypatch.setenv("MOBIZO_TASK_DATA_DIR", str(tmp_path / "no-such-data"))
    with pytest.raises(MobizoError, match="no-such-data lacks sst2/train.jsonl"):
        make_tiny_model(tmp_path / "model", seed=0)
    assert not (tmp_path / "model").exists()
    assert main(["make-tiny-model", "--out", str(tmp_path / "cli")]) == 1
    assert "MOBIZO_TASK_DATA_DIR" in capsys.readouterr().err


def test_tokenizer_refuses_a_shorter_data_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The samples in data/ must hold every line the tokenizer is trained on: one line less, another tokenizer."""
    import shutil

    from shared.tasks import task_data_dir

    data = Path(shutil.copytree(task_data_dir(), tmp_path / "data"))
    lines = (data / "rte" / "train.jsonl").read_bytes().splitlines(keepends=True)
    (data / "rte" / "train.jsonl").write_bytes(b"".join(lines[:299]))
    monkeypatch.setenv("MOBIZO_TASK_DATA_DIR", str(data))
    with pytest.raises(MobizoError, match="first 300 lines of .*rte/train.jsonl, which has 299"):
        make_tiny_model(tmp_path / "model", seed=0)


def test_fills_an_empty_folder_then_replaces_the_model(tmp_path: Path) -> None:
    out = tmp_path / "model"
    out.mkdir()
    make_tiny_model(out, seed=1)
    make_tiny_model(out, seed=0, layers=1)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_refuses_to_replace_a_folder_that_is_not_a_model(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(UsageError, match="--out"):
        make_tiny_model(tmp_path, seed=0)
    assert (tmp_path / "notes.txt").read_text() == "keep me"


# --- make-tiny-model command --------------------------------------------------------------------------------


def test_cli_make_tiny_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m"
    assert (
        main(["make-tiny-model", "--out", str(out), "--seed", "3", "--layers", "1", "--hidden", "32", "--vocab", "300"])
        == 0
    )
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (1, 32, 300)
    model, _ = load_model(out)
    assert f"{count_params(model):,} parameters" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flag", "value"), [("--layers", "0"), ("--hidden", "12"), ("--hidden", "0"), ("--vocab", "100")]
)
def test_cli_make_tiny_model_rejects_bad_sizes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    assert main(["make-tiny-model", "--out", str(tmp_path / "m"), flag, value]) == 2
    assert f"argument {flag}" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()
