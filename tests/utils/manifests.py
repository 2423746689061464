"""Complete program manifests (``shared.manifest.ProgramManifest`` as JSON) for programs that were never exported:
the fake compilers and mocked servers of the server and agent tests."""

from __future__ import annotations

from typing import Any

from shared.manifest import FORMAT_VERSION, ProgramConfig, ProgramInputs, ProgramManifest


def fake_manifest(
    config: dict[str, Any],
    files: dict[str, dict[str, Any]],
    lora: list[dict[str, Any]] = (),
    lora_size: int | None = None,
    memory_mb: int = 1,
) -> dict[str, Any]:
    """``files``: ``pte``, ``ptd`` and ``tokenizer`` as ``{"file", "sha256", "size"}``; ``lora_size`` defaults to
    the sum of the LoRA modules' B sizes."""
    cfg = ProgramConfig.model_validate(config)
    if lora_size is None:
        lora_size = sum(m["out_features"] * cfg.rank for m in lora)
    manifest = ProgramManifest(
        format=FORMAT_VERSION,
        config=cfg,
        methods=cfg.methods,
        lora=list(lora),
        lora_size=lora_size,
        inputs=ProgramInputs(forward={}, padding="left"),
        init_b=None,
        memory_mb=memory_mb,
        export_seconds=0.0,
        **files,
    )
    return manifest.model_dump(mode="json")
