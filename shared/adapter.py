"""Adapter files in PEFT's LoRA layout (``adapter_config.json`` + ``adapter_model.safetensors``, A included), and
the base they were trained on (``mobizo_base.json``: its registered name and ``shared.model_files.model_sha256``,
the hash of its config, weights and tokenizer).

Apps load them with ``peft.PeftModel.from_pretrained(base, dir)``; mobizo loads them with :func:`load_adapter`.
PEFT's scaling is ``lora_alpha / r``, the same as ours, so the two give the same logits. An adapter applied to
another base gives plausible-looking garbage, so mobizo's commands refuse it (:func:`check_base`) unless told.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from shared.errors import MobizoError
from shared.files import atomic_dir
from shared.lora import MPLoRA, inject_lora, lora_a_init, unflatten_b
from shared.manifest import ProgramManifest
from shared.text_fields import escape_controls

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
BASE_FILE = "mobizo_base.json"  # {"name": the base's registered name, "sha256": its model_sha256}
CARD_FILE = "README.md"  # the model card: the hub's front matter, the prompt contract and provenance for people
CARD_DATA = "mobizo_card.json"  # the same for programs: {"task", "prompt": {...}, "provenance": {...}}
_PREFIX = "base_model.model."


def _key(name: str, matrix: str) -> str:
    return f"{_PREFIX}{name}.{matrix}.weight"


def adapter_config(rank: int, alpha: float, targets: tuple[str, ...], base_model: str) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": sorted(targets),
        "base_model_name_or_path": base_model,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
    }


def save_adapter(
    out_dir: Path,
    lora_a: dict[str, torch.Tensor],
    lora_b: dict[str, torch.Tensor],
    rank: int,
    alpha: float,
    targets: tuple[str, ...],
    base_model: str,
    base_sha256: str | None = None,
    card: dict | None = None,
) -> Path:
    """Write a PEFT adapter directory atomically (``shared.files.atomic_dir``), replacing one already there; with
    ``base_sha256`` (the base's ``model_sha256``) the base is pinned in ``BASE_FILE``; with ``card`` (``task``,
    ``prompt``, ``provenance``: ``server.verify.card_of``) the card is written beside it (``write_card``)."""
    tensors = {_key(n, "lora_A"): a.detach().float().contiguous().cpu() for n, a in lora_a.items()}
    tensors |= {_key(n, "lora_B"): b.detach().float().contiguous().cpu() for n, b in lora_b.items()}
    with atomic_dir(Path(out_dir)) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_FILE))
        (tmp / CONFIG_FILE).write_text(json.dumps(adapter_config(rank, alpha, targets, base_model), indent=2))
        if base_sha256 is not None:
            (tmp / BASE_FILE).write_text(json.dumps({"name": base_model, "sha256": base_sha256}, indent=2))
        if card is not None:
            write_card(tmp, base_model, card)
    return Path(out_dir)


def make_card(
    task: str,
    template: str | None,
    verbalizer: dict | None,
    chat_template: bool,
    objective: str,
    prior: tuple[float, ...] | list[float] | None,
    **provenance: Any,
) -> dict:
    """An adapter's card (``CARD_DATA``): the prompt it trained with (template and verbalizer None: the task's own)
    and where it came from (``provenance``: a job, its steps, the device, privacy; None values are left out of
    ``README.md``)."""
    prompt = {"template": template, "verbalizer": verbalizer, "chat_template": bool(chat_template)}
    prompt |= {"objective": objective, "prior": list(prior or [])}
    return {"task": task, "prompt": prompt, "provenance": provenance}


_PUNCTUATION = re.compile(r"""([!-/:-@\[-`{-~])""")  # every ASCII punctuation character


def markdown_text(value: Any) -> str:
    """``str(value)`` as Markdown text that shows it as it is and nothing else, in a heading or a table cell: on one
    line (a line break written as ``\\n``, other control characters as ``shared.text_fields.escape_controls`` writes
    them), every ASCII punctuation character escaped with a backslash (CommonMark and GitHub's Markdown take any such
    escape), so that no backtick, ``|``, ``<``, ``&``, ``[`` or ``!`` of the value opens a code span, a table cell,
    raw HTML, an entity, a link or an image."""
    one_line = escape_controls(str(value)).replace("\n", "\\n")
    return _PUNCTUATION.sub(r"\\\1", one_line)


def write_card(adapter_dir: Path, base_model: str, card: dict) -> None:
    """The adapter's card: ``CARD_DATA`` as given, and ``CARD_FILE``, a model card with the hub's front matter
    (``base_model``, ``library_name: peft``) saying how to prompt it and where it came from. Every value of the
    card, a user's text included (the template, the verbalizer, the task), is written as ``markdown_text``."""
    prompt, provenance = card["prompt"], card["provenance"]
    (Path(adapter_dir) / CARD_DATA).write_text(json.dumps(card, indent=2, sort_keys=True) + "\n")
    template = "the task's own" if prompt["template"] is None else markdown_text(json.dumps(prompt["template"]))
    verbalizer = "the task's own" if prompt["verbalizer"] is None else markdown_text(json.dumps(prompt["verbalizer"]))
    task, base, text = markdown_text(card["task"]), markdown_text(base_model), markdown_text
    lines = [
        "---",
        f"base_model: {json.dumps(base_model)}",
        "library_name: peft",
        "pipeline_tag: text-generation",
        "tags: [mobizo, lora, zeroth-order, on-device]",
        "---",
        "",
        f"# A personal {task} adapter of {base}",
        "",
        "A LoRA adapter (PEFT layout) trained on a user's own device by mobizo: zeroth-order steps through an",
        "inference engine, only B trained. It was trained on prompts of one shape; prompt it the same way.",
        "",
        "## How to prompt it",
        "",
        "| | |",
        "|---|---|",
        f"| task | {task} |",
        f"| template | {template} |",
        f"| verbalizer | {verbalizer} |",
        f"| chat template | {'yes' if prompt['chat_template'] else 'no'} |",
        f"| objective | {text(prompt['objective'])} |",
        f"| calibration prior | {text(prompt['prior']) if prompt['prior'] else 'none'} |",
        "",
        "## Where it came from",
        "",
        "| | |",
        "|---|---|",
        *(
            f"| {text(name.replace('_', ' '))} | {text(value)} |"
            for name, value in sorted(provenance.items())
            if value is not None
        ),
        "",
        f"`{CARD_DATA}` holds the same for programs; `mobizo eval --adapter` prompts with it by default.",
        "",
    ]
    (Path(adapter_dir) / CARD_FILE).write_text("\n".join(lines))


def adapter_card(adapter_dir: Path) -> dict | None:
    """The card an adapter directory carries (``CARD_DATA``); None where it carries none."""
    path = Path(adapter_dir) / CARD_DATA
    if not path.is_file():
        return None
    try:
        card = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise MobizoError(f"cannot read {path}: {exc}") from exc
    prompt = card.get("prompt") if isinstance(card, dict) else None
    if not (isinstance(prompt, dict) and isinstance(card.get("task"), str) and "template" in prompt):
        raise MobizoError(f"{path}: expected {{'task': ..., 'prompt': {{'template': ...}}, ...}}")
    return card


def save_lora(
    out_dir: Path,
    lora: MPLoRA,
    b_flat: torch.Tensor,
    base_model: str,
    base_sha256: str | None = None,
    card: dict | None = None,
) -> Path:
    """Write the adapter of an injected model whose master B is ``b_flat``."""
    a, b = lora.lora_a(), lora.split(b_flat)
    return save_adapter(out_dir, a, b, lora.rank, lora.alpha, lora.targets, base_model, base_sha256, card)


def save_program_adapter(
    out_dir: Path,
    manifest: ProgramManifest,
    b_flat: torch.Tensor,
    base_model: str,
    base_sha256: str | None = None,
    card: dict | None = None,
) -> Path:
    """Write the adapter of a program (its manifest's LoRA layout): A regenerated from the seed, B from ``b_flat``.

    What the server packages for apps and what a device keeps locally, without the model.
    """
    config = manifest.config
    lora_a = {m.name: lora_a_init(config.a_seed, m.name, config.rank, m.in_features) for m in manifest.lora}
    shapes = {m.name: (m.out_features, config.rank) for m in manifest.lora}
    lora_b = unflatten_b(torch.as_tensor(b_flat, dtype=torch.float32), shapes)
    layout = (config.rank, config.alpha, config.targets)
    return save_adapter(out_dir, lora_a, lora_b, *layout, base_model, base_sha256, card)


def adapter_base(adapter_dir: Path) -> dict | None:
    """The base an adapter directory pins (``{"name", "sha256"}``); None where it pins none (written elsewhere, or
    before mobizo pinned bases)."""
    path = Path(adapter_dir) / BASE_FILE
    if not path.is_file():
        return None
    try:
        base = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise MobizoError(f"cannot read {path}: {exc}") from exc
    if not (isinstance(base, dict) and isinstance(base.get("sha256"), str) and isinstance(base.get("name"), str)):
        raise MobizoError(f"{path}: expected {{'name': ..., 'sha256': ...}}")
    return base


def check_base(adapter_dir: Path, model_dir: Path, allow_other: bool = False) -> str | None:
    """Refuse to apply the adapter in ``adapter_dir`` to the model in ``model_dir`` when it pins another base
    (``UsageError`` on field ``model``, naming both hashes). ``allow_other``: apply it all the same → the warning to
    show the user; None when the base is the pinned one or the adapter pins none."""
    from shared.errors import UsageError
    from shared.model_files import model_sha256

    pinned = adapter_base(adapter_dir)
    if pinned is None:
        return None
    actual = model_sha256(Path(model_dir))
    if actual == pinned["sha256"]:
        return None
    what = (
        f"the adapter {adapter_dir} was trained on {pinned['name']!r} (sha256 {pinned['sha256']}); {model_dir} is "
        f"another model (sha256 {actual})"
    )
    if not allow_other:
        raise UsageError("model", f"{what}: its outputs there would be garbage (--allow-other-base applies it anyway)")
    return f"WARNING: {what}: applied anyway (--allow-other-base)"


def read_adapter(adapter_dir: Path) -> tuple[dict, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(config, {module: A}, {module: B}) of a PEFT adapter directory."""
    adapter_dir = Path(adapter_dir)
    try:
        config = json.loads((adapter_dir / CONFIG_FILE).read_text())
        tensors = load_file(str(adapter_dir / WEIGHTS_FILE))
    except (OSError, ValueError) as exc:
        raise MobizoError(f"cannot read adapter {adapter_dir}: {exc}") from exc
    if config.get("peft_type") != "LORA":
        raise MobizoError(f"{adapter_dir}: not a LoRA adapter (peft_type {config.get('peft_type')!r})")
    split: dict[str, dict[str, torch.Tensor]] = {"lora_A": {}, "lora_B": {}}
    for key, value in tensors.items():
        name, matrix = key.removeprefix(_PREFIX).removesuffix(".weight").rsplit(".", 1)
        split[matrix][name] = value
    return config, split["lora_A"], split["lora_B"]


def load_adapter(model: nn.Module, adapter_dir: Path) -> tuple[MPLoRA, torch.Tensor]:
    """Inject LoRA into ``model`` with the adapter's A and B; the model then runs base + adapter.

    Returns the LoRA handle and the flat B (the model keeps running it until ``lora.apply`` is called again).
    """
    config, lora_a, lora_b = read_adapter(adapter_dir)
    lora = inject_lora(model, tuple(config["target_modules"]), int(config["r"]), float(config["lora_alpha"]))
    if set(lora_a) != set(lora.layers) or set(lora_b) != set(lora.layers):
        raise MobizoError(f"{adapter_dir}: adapter modules do not match the model's {config['target_modules']}")
    for name, layer in lora.layers.items():
        if lora_a[name].shape != layer.lora_A.shape:
            raise MobizoError(f"{adapter_dir}: {name} lora_A has shape {tuple(lora_a[name].shape)}")
        layer.lora_A.copy_(lora_a[name])
    b_flat = lora.join(lora_b).to(lora.device)
    lora.apply(b_flat[None])
    return lora, b_flat


def merge_adapter(model_dir: Path, adapter_dir: Path, out_dir: Path, dtype: str = "float32") -> Path:
    """A plain Hugging Face model with the adapter folded in, for runtimes without LoRA: each target linear's weight
    becomes ``W + (lora_alpha / r) · B·A``, computed in float32 by PEFT's ``merge_and_unload``, then stored in
    ``dtype``; the base's tokenizer and the prompts chosen for it (``mobizo_prompts.json``) go beside it. Written
    through ``shared.files.atomic_dir`` → ``out_dir``. The adapter's base is the caller's to check
    (:func:`check_base`)."""
    import shutil

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.backends import MERGE_DTYPES
    from shared.prompts import PROMPTS_FILE

    if dtype not in MERGE_DTYPES:
        raise MobizoError(f"dtype {dtype!r}: choose one of {', '.join(MERGE_DTYPES)}")
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    merged = PeftModel.from_pretrained(base, Path(adapter_dir)).merge_and_unload().to(getattr(torch, dtype))
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    with atomic_dir(out_dir) as tmp:
        merged.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if (model_dir / PROMPTS_FILE).is_file():
            shutil.copyfile(model_dir / PROMPTS_FILE, tmp / PROMPTS_FILE)
    return out_dir
