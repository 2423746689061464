"""The program contract (``shared.manifest``): a config that checks itself, and a manifest whose JSON is the file's."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from shared.errors import FieldError
from shared.manifest import (
    FirstOrderManifest,
    ProgramConfig,
    ProgramManifest,
    manifest_path,
    read_manifest,
    read_training_manifest,
)
from shared.schemas import HyperParams
from tests.utils.manifests import fake_manifest

FILES = {entry: {"file": f"{entry}.bin", "sha256": "0" * 64, "size": 1} for entry in ("pte", "ptd", "tokenizer")}


@pytest.mark.parametrize(
    ("change", "field"), [({"q": 3}, "batch_size"), ({"answer_len": 16}, "seq_len"), ({"answer_len": 17}, "seq_len")]
)
def test_config_checks_itself_naming_the_field(change: dict, field: str) -> None:
    with pytest.raises(ValidationError) as info:
        ProgramConfig(**({"q": 2, "batch_size": 4, "seq_len": 16, "answer_len": 2} | change))
    cause = info.value.errors()[0]["ctx"]["error"]
    assert isinstance(cause, FieldError) and cause.field == field


def test_config_from_a_job_spec() -> None:
    spec = HyperParams(q=2, batch_size=8, seq_len=32, rank=4, alpha=8, targets=["q_proj"], program_backend="portable")
    cfg = ProgramConfig.from_spec(spec, answer_len=3)
    assert cfg == ProgramConfig.from_spec(spec.model_dump(mode="json"), answer_len=3)
    got = (cfg.q, cfg.examples_per_query, cfg.answer_len, cfg.targets, cfg.backend)
    assert got == (2, 4, 3, ("q_proj",), "portable")
    assert cfg.model_dump(mode="json")["targets"] == ["q_proj"] and isinstance(cfg.alpha, float)


def test_manifest_json_round_trips_and_leaves_the_model_path_out_of_leases() -> None:
    written = fake_manifest({"q": 1, "batch_size": 2, "seq_len": 16, "answer_len": 1}, FILES) | {"model": "/srv/m"}
    manifest = ProgramManifest.model_validate(written)
    assert json.loads(manifest.to_json()) == written
    order = "format model config methods lora lora_size inputs pte ptd tokenizer init_b memory_mb export_seconds"
    assert list(json.loads(manifest.to_json())) == order.split()  # the key order of the file (docs/contracts.md)
    device = manifest.for_device().model_dump(mode="json")
    assert "model" not in device and device == {k: v for k, v in written.items() if k != "model"}


def test_a_format_1_manifest_starting_from_zeros_still_reads() -> None:
    """Stored format-1 manifests (server programs) wrote ``init_b: false``: read as no starting B file."""
    written = fake_manifest({"q": 1, "batch_size": 2, "seq_len": 16, "answer_len": 1}, FILES) | {"init_b": False}
    assert ProgramManifest.model_validate(written).init_b is None


def _first_order(config: dict) -> dict:
    """A first-order manifest as ``shared.fo_program.export_first_order`` writes it (its keys in the file's order)."""
    cfg = ProgramConfig.model_validate(config).model_dump(mode="json")
    return (
        {"kind": "first-order", "model": "/srv/m", "config": cfg, "lora_size": 64}
        | FILES
        | {
            "planned_bytes": {"forward": 1024},
            "export_seconds": 1.5,
        }
    )


def test_each_training_kind_reads_as_its_own_manifest_and_a_zeroth_order_one_is_unchanged(tmp_path) -> None:
    """A zeroth-order manifest has no ``kind`` and reads byte for byte as before; a first-order one is typed and
    checked as the others are, and neither kind reads as the other."""
    config = {"q": 1, "batch_size": 2, "seq_len": 16, "answer_len": 1}
    zeroth, first = fake_manifest(config, FILES), _first_order(config)
    for name, written in (("zo", zeroth), ("fo", first)):
        manifest_path(tmp_path / f"{name}.pte").write_text(json.dumps(written))
    read = read_training_manifest(tmp_path / "zo.pte")
    assert type(read) is ProgramManifest and read == read_manifest(tmp_path / "zo.pte")
    assert "kind" not in json.loads(read.to_json()) and json.loads(read.to_json()) == zeroth
    read = read_training_manifest(tmp_path / "fo.pte")
    assert type(read) is FirstOrderManifest and json.loads(read.to_json()) == first
    assert "model" not in read.for_device().model_dump(mode="json")
    with pytest.raises(ValidationError, match="the manifest of a first-order program"):
        read_manifest(tmp_path / "fo.pte")
    with pytest.raises(ValidationError, match="kind"):
        FirstOrderManifest.model_validate(zeroth)
    for broken in ({"lora_size": -1}, {"kind": "second-order"}, {"config": config | {"q": 3}}):
        with pytest.raises(ValidationError):
            FirstOrderManifest.model_validate(first | broken)
