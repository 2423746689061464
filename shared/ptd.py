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


def canonical_ptd(raw: Path):
    """The named tensors of the ``.ptd`` at ``raw``, keys sorted, each segment aligned as ExecuTorch aligns them
    (128 B), and each distinct content stored once: keys whose bytes are equal name one segment. A tied embedding is
    one tensor under two keys (the lookup's, and XNNPACK's for ``lm_head``), 113 MB of SmolLM2's weights.

    Returns the file's bytes as a ``Cord`` (the segments themselves, not joined), to be written piece by piece; the
    file is read here, so that its bytes are freed once its segments are cut out of them."""
    import hashlib

    from executorch.exir._serialize._cord import Cord
    from executorch.exir._serialize.data_serializer import DataEntry, DataPayload
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorSerializer

    serializer = FlatTensorSerializer()
    payload = serializer.deserialize(Cord(raw.read_bytes()))
    buffers: list = []
    index: dict[tuple[int, bytes], int] = {}  # (size, sha256) of a content -> its segment
    named = {}
    for key in sorted(payload.named_data):
        entry = payload.named_data[key]
        buffer = payload.buffers[entry.buffer_index]
        found = index.setdefault((len(buffer), hashlib.sha256(buffer).digest()), len(buffers))
        if found == len(buffers):
            buffers.append(buffer)
        named[key] = DataEntry(buffer_index=found, alignment=1, tensor_layout=entry.tensor_layout)
    return serializer.serialize(DataPayload(buffers=buffers, named_data=named))


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
    """Write a lowered program's weights ``.ptd`` canonically into ``store`` by content: (path, sha256)."""
    with tempfile.TemporaryDirectory(dir=store, prefix=".ptd.") as tmp:
        manager.write_tensor_data_to_file(tmp)
        raw = Path(tmp) / f"{WEIGHTS_TAG}.ptd"
        atomic_write(raw, canonical_ptd(raw).write_to_file)
        return store_by_content(raw, store, "weights-", ".ptd")
