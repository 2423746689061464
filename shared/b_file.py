"""B files: the flat LoRA-B vector as it travels between device and server (the one home of that format).

A B file is a safetensors file holding exactly one float32 tensor named ``b_flat`` of shape [D] (docs/contracts.md:
``get_lora_b()`` of the program): the result a device uploads, the starting B a lease points to, what the server
keeps under ``adapters/<sha256>.safetensors``. Torch-free (NumPy), so the server checks uploads in the request.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shared.errors import DataError
from shared.model_files import read_safetensors_header

B_FLAT_KEY = "b_flat"


def b_file_bytes(b_flat: np.ndarray) -> bytes:
    """``b_flat`` (any array of D values) as the bytes of a B file."""
    from safetensors.numpy import save

    return save({B_FLAT_KEY: np.ascontiguousarray(b_flat, dtype=np.float32).reshape(-1)})


def _check_header(path: Path, d: int | None) -> None:
    header = read_safetensors_header(path)
    names = sorted(k for k in header if k != "__metadata__")
    if names != [B_FLAT_KEY]:
        raise DataError(f"expected one tensor named {B_FLAT_KEY!r}, got {names}")
    info = header[B_FLAT_KEY]
    if info.get("dtype") != "F32":
        raise DataError(f"dtype must be float32 (F32), got {info.get('dtype')}")
    shape = info.get("shape")
    if d is not None and shape != [d]:
        raise DataError(f"shape must be [{d}] for this job's program, got {shape}")
    if not isinstance(shape, list) or len(shape) != 1:
        raise DataError(f"shape must be [D], got {shape}")


def read_b_file(path: Path, d: int | None = None) -> np.ndarray:
    """The float32 [D] vector of a B file, checked: one tensor ``b_flat``, float32, shape [d] (when given), every
    value finite. ``DataError`` says what is wrong."""
    from safetensors.numpy import load_file

    _check_header(Path(path), d)
    try:
        values = load_file(str(path))[B_FLAT_KEY]
    except Exception as exc:  # safetensors raises its own error types for truncated or inconsistent files
        raise DataError(f"unreadable safetensors file ({exc})") from None
    if not np.isfinite(values).all():
        raise DataError(f"{int((~np.isfinite(values)).sum())} values are NaN or infinite")
    return values.astype(np.float32, copy=False)
