"""Reading a Hugging Face model directory without torch: its content hash and its linear layers.

Registration (an admin request) must not load the model into the server process, so the linear layers a job may
target are read from the safetensors headers: every 2-D ``<module>.weight`` outside the embeddings.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path

from shared.errors import DataError

_HASHED_SUFFIXES = (".json", ".safetensors", ".model", ".txt")
_MAX_HEADER = 100 * 1024 * 1024


def read_safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file (tensor name -> dtype, shape, data_offsets; plus __metadata__)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise DataError(f"{path.name}: not a safetensors file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", raw)
        if length > _MAX_HEADER:
            raise DataError(f"{path.name}: safetensors header of {length} bytes is too large")
        blob = f.read(length)
    try:
        header = json.loads(blob)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise DataError(f"{path.name}: safetensors header is not JSON (or nested too deep)") from None
    if not isinstance(header, dict):
        raise DataError(f"{path.name}: safetensors header is not an object")
    for name, info in header.items():
        problem = _metadata_problem(info) if name == "__metadata__" else _tensor_problem(info)
        if problem:
            raise DataError(f"{path.name}: safetensors header entry {name[:64]!r} {problem}")
    return header


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _tensor_problem(info: object) -> str | None:
    """Why a tensor's header entry is not ``{"dtype": str, "shape": [int >= 0], "data_offsets": [int, int]}``."""
    if not isinstance(info, dict):
        return "is not an object"
    if not isinstance(info.get("dtype"), str):
        return "has no dtype string"
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(_is_int(n) and n >= 0 for n in shape):
        return "has no shape of non-negative integers"
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(n) and n >= 0 for n in offsets):
        return "has no data_offsets [begin, end]"
    return None


def _metadata_problem(info: object) -> str | None:
    """Why ``__metadata__`` is not an object of strings (the format's rule)."""
    if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
        return "is not an object of strings"
    return None


def _hashed(name: str) -> bool:
    """A file that defines the model; the prompts chosen for it (``shared.prompts.PROMPTS_FILE``) do not."""
    return name.endswith(_HASHED_SUFFIXES) and name != "mobizo_prompts.json"


def model_sha256(model_dir: Path) -> str:
    """Hash of the files that define the model (config, weights, tokenizer), names included, in sorted order: not
    the prompts chosen for it (``mobizo_prompts.json``)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in model_dir.iterdir() if p.is_file() and _hashed(p.name)):
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def linear_modules(model_dir: Path) -> dict[str, list[int]]:
    """Module name -> [out_features, in_features] for every 2-D weight except embeddings."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise DataError(f"{model_dir}: no *.safetensors weights")
    modules: dict[str, list[int]] = {}
    for path in files:
        for name, info in read_safetensors_header(path).items():
            if name == "__metadata__" or not name.endswith(".weight") or "embed" in name:
                continue
            if len(info.get("shape", [])) == 2:
                modules[name.removesuffix(".weight")] = [int(d) for d in info["shape"]]
    return modules


def float32_bytes(model_dir: Path) -> int:
    """Bytes of the model's weights once loaded in float32 (as an export loads them), from the headers alone."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise DataError(f"{model_dir}: no *.safetensors weights")
    count = 0
    for path in files:
        for name, info in read_safetensors_header(path).items():
            if name != "__metadata__":
                count += math.prod(int(d) for d in info.get("shape", []))
    return 4 * count


def inspect_model(model_dir: Path) -> tuple[str, str, dict[str, list[int]]]:
    """(sha256, architecture, linear modules) of a model directory; ``DataError`` saying what is missing, naming
    files inside the directory only (the directory is the caller's input: its answer does not repeat it)."""
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise DataError("no config.json (not a Hugging Face model directory)")
    try:
        config = json.loads(config_file.read_text())
    except (ValueError, RecursionError):  # JSONDecodeError, UnicodeDecodeError, a number too long
        raise DataError("config.json: not JSON") from None
    if not isinstance(config, dict):
        raise DataError("config.json: not a JSON object")
    architectures = config.get("architectures")
    if isinstance(architectures, list) and architectures:
        architecture = architectures[0]
    else:
        architecture = config.get("model_type", "unknown")
    if not isinstance(architecture, str) or len(architecture) > 128:
        raise DataError("config.json: architectures[0] (or model_type) must be a string of at most 128 characters")
    if not sorted(model_dir.glob("*.safetensors")):
        raise DataError("no *.safetensors weights")
    modules = linear_modules(model_dir)
    if not modules:
        raise DataError("no linear layers found in the weights")
    return model_sha256(model_dir), architecture, modules


CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")  # where newer tokenizers keep it


def has_chat_template(model_dir: Path) -> bool:
    """Whether the directory's tokenizer has a chat template (``tokenizer_config.json``'s ``chat_template``, or a
    file of its own), as ``transformers`` finds it: read without loading the tokenizer, so that a job asking for
    ``chat_template`` on a model without one is refused when it is submitted, not when it compiles."""
    try:
        if any((model_dir / name).is_file() for name in CHAT_TEMPLATE_FILES):
            return True
        config_file = model_dir / "tokenizer_config.json"
        if not config_file.is_file():
            return False
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # unreadable, or not JSON: no template the compile could use
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))
