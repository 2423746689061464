"""The tokenizer as one file, for devices: a device tokenizes its local data exactly as the server's model does."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from shared.errors import MobizoError


def tokenizer_bytes(tokenizer: PreTrainedTokenizerFast) -> bytes:
    """The tokenizer as it actually encodes (pipeline and post-processor included) plus its special tokens.

    One JSON file, so a device tokenizes its local data exactly as the server's model does, and the file can be
    content-addressed like the weights.
    """
    specials = {k: getattr(tokenizer, k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    payload = {"tokenizer": json.loads(tokenizer.backend_tokenizer.to_str()), "special_tokens": specials}
    return json.dumps(payload, sort_keys=True).encode()


def load_tokenizer_file(path: Path) -> PreTrainedTokenizerFast:
    """Inverse of :func:`tokenizer_bytes`."""
    from tokenizers import Tokenizer

    try:
        payload = json.loads(Path(path).read_text())
        backend = Tokenizer.from_str(json.dumps(payload["tokenizer"]))
    except (OSError, ValueError, KeyError) as exc:
        raise MobizoError(f"cannot read tokenizer file {path}: {exc}") from exc
    specials = {k: v for k, v in payload["special_tokens"].items() if v is not None}
    return PreTrainedTokenizerFast(tokenizer_object=backend, **specials)
