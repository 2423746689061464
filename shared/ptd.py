"""The shared weights file (``.ptd``) written in one canonical byte layout, whichever program wrote it.

ExecuTorch lays out the named tensors of a ``.ptd`` in the order the lowering met them, which differs between a
training program and the inference program of the same model although both hold the same tensors under the same
names. Rewritten with the keys sorted, the file depends only on its (name, bytes) pairs, so both programs store
the very same ``weights-<sha256>.ptd`` and a device keeps one copy of the base.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from shared.files import atomic_write, store_by_content

WEIGHTS_TAG = "weights"  # name of the external data file the frozen weights go to


def program_named_tensors(manager, tag: str = WEIGHTS_TAG) -> dict[str, tuple]:
    """key -> (bytes, tensor layout) of every tensor an emitted program (ExecuTorch's program manager) puts in its
    ``tag`` data file, read from the manager's memory (no copy of a weight): the constants the emitter placed outside
    the ``.pte`` and the named data its backends stored for that file (XNNPACK's weights). A key both hold names
    the same bytes, as ExecuTorch requires when it merges them; the emitter's come first, as in its own file."""
    from executorch.exir._serialize._serialize import _extract_external_tensor_layouts

    emitted = manager._emitter_output
    tensors = {}
    constants = emitted.external_constant_map.get(tag, {})
    if constants:
        layouts = _extract_external_tensor_layouts(emitted.program)
        for key, index in constants.items():
            tensors[key] = (emitted.external_constant_buffer[index], layouts[key])
    named = manager._named_data
    if named is not None:
        for key, entry in named.external_data.get(tag, {}).items():
            tensors.setdefault(key, (named.buffers[entry.buffer_index], entry.tensor_layout))
    return tensors


def canonical_ptd(tensors: dict[str, tuple]):
    """The ``.ptd`` of ``tensors`` (key -> (bytes, tensor layout)) with its keys sorted, each segment aligned as
    ExecuTorch aligns them (128 B), and each distinct content stored once: keys whose bytes are equal name one
    segment. A tied embedding is one tensor under two keys (the lookup's, and XNNPACK's for ``lm_head``), 113 MB of
    SmolLM2's weights.

    Returns the file's bytes as a ``Cord`` of the tensors' own buffers (not joined), to be written piece by piece."""
    import hashlib

    from executorch.exir._serialize.data_serializer import DataEntry, DataPayload
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorSerializer

    buffers: list = []
    index: dict[tuple[int, bytes], int] = {}  # (size, sha256) of a content -> its segment
    named = {}
    for key in sorted(tensors):
        buffer, layout = tensors[key]
        if not isinstance(buffer, (bytes, bytearray, memoryview)):
            raise TypeError(f"the weights file's tensor {key!r} is held as {type(buffer).__name__}, not bytes")
        found = index.setdefault((len(buffer), hashlib.sha256(buffer).digest()), len(buffers))
        if found == len(buffers):
            buffers.append(buffer)
        named[key] = DataEntry(buffer_index=found, alignment=1, tensor_layout=layout)
    return FlatTensorSerializer().serialize(DataPayload(buffers=buffers, named_data=named))


def ptd_contents(data: bytes) -> dict[str, tuple[int, int]]:
    """key -> (segment index, size in bytes) of a ``.ptd``: which keys share a segment, and how large each is."""
    from executorch.exir._serialize._cord import Cord
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorSerializer

    payload = FlatTensorSerializer().deserialize(Cord(data))
    return {
        key: (entry.buffer_index, len(bytes(payload.buffers[entry.buffer_index])))
        for key, entry in payload.named_data.items()
    }


def store_weights(manager, store: Path) -> tuple[Path, str]:
    """Write a lowered program's weights ``.ptd`` canonically into ``store`` by content: (path, sha256). Written
    from the tensors the program manager holds, not from ExecuTorch's own file read back (which would hold two more
    copies of the weights at once: the file's bytes and the segments cut from them)."""
    with tempfile.TemporaryDirectory(dir=store, prefix=".ptd.") as tmp:
        raw = Path(tmp) / f"{WEIGHTS_TAG}.ptd"
        atomic_write(raw, canonical_ptd(program_named_tensors(manager)).write_to_file)
        return store_by_content(raw, store, "weights-", ".ptd")
