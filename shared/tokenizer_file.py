"""The tokenizer as one file, for devices: a device tokenizes its local data exactly as the server's model does.

The server writes it from the model's Hugging Face tokenizer (``tokenizer_bytes``); a device reads it with the
``tokenizers`` library alone (``load_tokenizer_file`` → ``FileTokenizer``), so the device install needs neither
transformers nor torch. ``FileTokenizer`` offers the part of a Hugging Face fast tokenizer that mobizo calls
(``tokenizer(texts, add_special_tokens=...)["input_ids"]``, the special tokens' ids, ``decode``) and encodes
through the same Rust pipeline, so the ids are the same (tested against transformers on the shipped models).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shared.errors import MobizoError

SPECIALS = ("bos_token", "eos_token", "pad_token", "unk_token")


def tokenizer_bytes(tokenizer: Any) -> bytes:
    """The tokenizer as it actually encodes (pipeline and post-processor included) plus its special tokens.

    One JSON file, so a device tokenizes its local data exactly as the server's model does, and the file can be
    content-addressed like the weights. ``tokenizer``: a Hugging Face fast tokenizer.
    """
    specials = {k: getattr(tokenizer, k) for k in SPECIALS}
    payload = {"tokenizer": json.loads(tokenizer.backend_tokenizer.to_str()), "special_tokens": specials}
    return json.dumps(payload, sort_keys=True).encode()


class FileTokenizer:
    """A tokenizer file's encoder: the ``tokenizers`` pipeline with the model's special tokens.

    As a Hugging Face fast tokenizer encodes: no truncation, no padding, special tokens added by the
    post-processor only when asked."""

    def __init__(self, backend: Any, specials: dict[str, str | None]) -> None:
        backend.no_truncation()
        backend.no_padding()
        self.backend = backend
        for name in SPECIALS:
            token = specials.get(name)
            setattr(self, name, token)
            setattr(self, f"{name}_id", None if token is None else backend.token_to_id(token))

    def __call__(self, texts: str | list[str], add_special_tokens: bool = True) -> dict[str, Any]:
        if isinstance(texts, str):
            return {"input_ids": self.backend.encode(texts, add_special_tokens=add_special_tokens).ids}
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return {"input_ids": [e.ids for e in encodings]}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)


def load_tokenizer_file(path: Path) -> FileTokenizer:
    """Inverse of :func:`tokenizer_bytes`."""
    from tokenizers import Tokenizer

    try:
        payload = json.loads(Path(path).read_text())
        backend = Tokenizer.from_str(json.dumps(payload["tokenizer"]))
        specials = dict(payload["special_tokens"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise MobizoError(f"cannot read tokenizer file {path}: {exc}") from exc
    return FileTokenizer(backend, specials)
