"""Writing files and folders so that nothing is ever half-written, and naming files by content; private whatever
the umask.

Files written here are 0600 and the folders created for them 0700 unless the caller asks otherwise: they hold
private data (a device's tokenized examples and training log, the server's adapters and logs) and the umask of
whoever started the process (often 022) must not make them readable by every local user. ``atomic_dir`` makes
folders for people (a downloaded adapter), so it follows the umask.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


PRIVATE_FILE = 0o600
PRIVATE_DIR = 0o700


def make_dirs(path: Path) -> Path:
    """``path`` and its missing parents, each created 0700 (``mkdir``'s mode is masked by the umask, so set after).
    Folders that exist are left as they are: a caller owning one (a data dir) makes it private itself."""
    path = Path(path)
    missing = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    for folder in reversed(missing):
        folder.mkdir(mode=PRIVATE_DIR, exist_ok=True)
        os.chmod(folder, PRIVATE_DIR)
    return path


def private_dir(path: Path) -> Path:
    """``path`` created (``make_dirs``) or made 0700 if it existed."""
    os.chmod(make_dirs(path), PRIVATE_DIR)
    return path


def open_private(path: Path, mode: str = "wb", **kwargs):
    """``open(path, mode)``, a file it creates being 0600 from its first byte."""
    return open(path, mode, opener=lambda name, flags: os.open(name, flags, PRIVATE_FILE), **kwargs)


def default_mode(directory: bool = False) -> int:
    """The mode ``open``/``mkdir`` would give under the current umask (mkstemp/mkdtemp give 0600/0700)."""
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if directory else 0o666) & ~umask


def atomic_write(path: Path, write: Callable[[BinaryIO], None], mode: int | None = None) -> Path:
    """Call ``write(file)`` on a temporary file beside ``path``, fsync it, then rename it over ``path``.

    The file gets ``mode`` (default 0600, whatever the umask) before any byte is written, so it is never readable
    by others, not even for a moment; missing folders are created 0700.
    """
    path = Path(path)
    make_dirs(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, PRIVATE_FILE if mode is None else mode)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_bytes(path: Path, data: bytes, mode: int | None = None) -> Path:
    return atomic_write(path, lambda f: f.write(data), mode)


@contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``target`` to write into; on success fsync its files and rename it to
    ``target`` (replacing a folder already there), so no reader ever sees half of it; on error remove it.

    Whether an existing ``target`` may be replaced is the caller's decision, made before.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        yield tmp
        tmp.chmod(default_mode(directory=True))
        _fsync_tree(tmp)
        _replace_dir(tmp, target)
        _fsync_path(target.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def publish_once(target: Path, write: Callable[[Path], object]) -> None:
    """Call ``write(folder)`` on a new private folder beside ``target``, then rename it to ``target``. Of writers
    racing for one ``target`` (compile workers, test sessions), the first rename wins; a later one finds it taken and
    drops its copy, so a published folder is never replaced under a reader. Use ``atomic_dir`` to replace one."""
    tmp = make_dirs(Path(target).parent / f".tmp-{uuid.uuid4().hex}")
    try:
        write(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # published by another writer first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``; an existing ``dst`` is first moved aside, then deleted."""
    old = None
    if dst.exists():
        old = src.with_name(src.name + ".old")
        dst.rename(old)
    src.rename(dst)
    if old is not None:
        shutil.rmtree(old)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Every file under ``root``, then ``root`` itself, on disk."""
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        _fsync_path(path)
    _fsync_path(root)


def store_by_content(src: Path, store: Path, prefix: str, suffix: str) -> tuple[Path, str]:
    """Rename ``src`` (on the same file system) to ``store/{prefix}{sha256}{suffix}`` (made 0600), or drop it if
    that exists."""
    digest = sha256_file(src)
    dst = Path(store) / f"{prefix}{digest}{suffix}"
    if dst.exists():
        Path(src).unlink()
    else:
        with open(src, "rb") as f:
            os.fchmod(f.fileno(), PRIVATE_FILE)
            os.fsync(f.fileno())
        os.replace(src, dst)
    return dst, digest
