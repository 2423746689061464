"""An adapter pins the base it was trained on (``mobizo_base.json``: the base's name and ``model_sha256``), and every
mobizo command that applies an adapter (``mobizo eval``, ``generate``, ``export --adapter``, ``adapters merge``)
refuses another base, naming both hashes, unless ``--allow-other-base`` says otherwise (then it warns). An adapter
that pins no base (PEFT's own, or one written before pins) applies as before. ``mobizo adapters merge`` folds an
adapter into its base: a plain model that gives the base-plus-adapter logits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mobizo.cli import main
from shared.adapter import BASE_FILE, adapter_base, save_lora
from shared.hf_models import load_model
from shared.lora import inject_lora
from shared.model_files import model_sha256
from shared.tasks import task_data_dir


@pytest.fixture(scope="module")
def models(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(the base, another model of the same shapes, a pinned adapter trained on the base). The other model is the
    base with one weight moved: the same architecture, so only the pin tells them apart."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("bases")
    other = Path(shutil.copytree(tiny_model_dir, folder / "other"))
    weights = load_file(str(other / "model.safetensors"))
    name = next(n for n in sorted(weights) if n.endswith("q_proj.weight"))
    weights[name] = weights[name] + 0.5
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    model, _ = load_model(tiny_model_dir)
    lora = inject_lora(model, ("q_proj", "v_proj"), rank=2, alpha=4.0)
    torch.manual_seed(0)
    adapter = save_lora(folder / "adapter", lora, torch.randn(lora.size), "tiny", model_sha256(tiny_model_dir))
    return tiny_model_dir, other, adapter


def test_an_adapter_pins_its_bases_name_and_hash(models) -> None:
    base, other, adapter = models
    assert adapter_base(adapter) == {"name": "tiny", "sha256": model_sha256(base)}
    assert model_sha256(other) != model_sha256(base)


def _eval(model: Path, adapter: Path, *extra: str) -> list[str]:
    data = task_data_dir() / "sst2" / "validation.jsonl"
    return ["eval", "--model", str(model), "--adapter", str(adapter), "--task", "sst2", "--data", str(data), *extra]


def _generate(model: Path, adapter: Path, *extra: str) -> list[str]:
    return ["generate", "--model", str(model), "--adapter", str(adapter), "--prompt", "It was", *extra]


@pytest.mark.parametrize("command", [_eval, _generate], ids=["eval", "generate"])
def test_the_commands_refuse_another_base_naming_both_hashes_unless_told(models, command, capsys) -> None:
    base, other, adapter = models
    short = ("--limit", "4") if command is _eval else ("--max-new-tokens", "2")
    assert main(command(base, adapter, *short)) == 0
    capsys.readouterr()
    assert main(command(other, adapter, *short)) == 2
    err = capsys.readouterr().err
    assert "--model" in err and model_sha256(base) in err and model_sha256(other) in err
    assert "--allow-other-base" in err
    assert main(command(other, adapter, *short, "--allow-other-base")) == 0
    err = capsys.readouterr().err
    assert "WARNING" in err and model_sha256(base) in err and model_sha256(other) in err


def test_an_adapter_that_pins_no_base_applies_to_any(models, tmp_path: Path, capsys) -> None:
    _, other, adapter = models
    unpinned = Path(shutil.copytree(adapter, tmp_path / "unpinned"))
    (unpinned / BASE_FILE).unlink()
    assert adapter_base(unpinned) is None
    assert main(_eval(other, unpinned, "--limit", "4", "--json")) == 0
    assert json.loads(capsys.readouterr().out)["n"] == 4


def test_a_malformed_pin_is_an_error_naming_the_file(models, tmp_path: Path, capsys) -> None:
    base, _, adapter = models
    broken = Path(shutil.copytree(adapter, tmp_path / "broken"))
    (broken / BASE_FILE).write_text('{"name": "tiny"}')
    assert main(_eval(base, broken, "--limit", "4")) != 0
    assert BASE_FILE in capsys.readouterr().err


def test_mobizo_train_pins_the_model_it_trained(tiny_model_dir: Path, tmp_path: Path) -> None:
    from shared.train import TrainConfig, train

    sst2 = task_data_dir() / "sst2" / "train.jsonl"
    config = TrainConfig(tiny_model_dir, "sst2", sst2, tmp_path, steps=1, batch_size=2, q=1, limit_train=4)
    train(config, progress=False)
    (pinned,) = [adapter_base(p.parent) for p in tmp_path.rglob(BASE_FILE)]
    assert pinned == {"name": str(tiny_model_dir), "sha256": model_sha256(tiny_model_dir)}


def test_an_export_starts_from_an_adapter_only_on_its_base(models, tmp_path: Path, capsys) -> None:
    """``mobizo export --adapter`` goes on training from the adapter's B: on another base it is refused before any
    export (there is no override: a B moved on from another model's is no personalization of this one)."""
    _, other, adapter = models
    out = tmp_path / "program.pte"
    args = ["export", "--model", str(other), "--adapter", str(adapter), "--out", str(out), "--task", "sst2"]
    args += ["--q", "1", "--batch-size", "2", "--seq-len", "8"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--model" in err and model_sha256(other) in err and not out.exists()


def test_a_merged_model_is_a_plain_model_with_the_adapters_logits(models, tmp_path: Path, capsys) -> None:
    """``mobizo adapters merge``: the folder loads with ``AutoModelForCausalLM`` alone (no LoRA module in it) and
    its logits are PEFT's base + adapter within the float32 rounding bound of the model (tests/utils/tolerance.py),
    far from the base's own; on another base the merge is refused and nothing is written."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.utils.tolerance import loss_rtol

    base, other, adapter = models
    out = tmp_path / "merged"
    assert main(["adapters", "merge", "--model", str(base), "--adapter", str(adapter), "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True)
    assert not [name for name, _ in merged.named_parameters() if "lora" in name]
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, local_files_only=True)
    ids = torch.randint(3, plain.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = PeftModel.from_pretrained(plain, adapter).eval()(input_ids=ids).logits
        got = merged(input_ids=ids).logits
        base_logits = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)(input_ids=ids).logits
    atol = loss_rtol(merged.config) * float(want.abs().max())
    assert float((got - want).abs().max()) <= atol
    assert float((base_logits - want).abs().max()) > 100 * atol  # the adapter moved the logits
    assert (out / "tokenizer.json").is_file() or (out / "tokenizer_config.json").is_file()

    refused = tmp_path / "refused"
    args = ["adapters", "merge", "--model", str(other), "--adapter", str(adapter), "--out", str(refused)]
    assert main(args) == 2 and not refused.exists()
    assert model_sha256(other) in capsys.readouterr().err
