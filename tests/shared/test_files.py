"""Atomic folders (``shared.files.atomic_dir``): a reader sees the old folder or the new one, never half of one."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.files import atomic_dir, publish_once


def test_atomic_dir_creates_and_replaces_a_folder(tmp_path: Path) -> None:
    target = tmp_path / "out"
    with atomic_dir(target) as tmp:
        assert tmp.parent == tmp_path and not target.exists()
        (tmp / "a.txt").write_text("first")
    assert (target / "a.txt").read_text() == "first"
    with atomic_dir(target) as tmp:
        (tmp / "b.txt").write_text("second")
    assert [p.name for p in target.iterdir()] == ["b.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary or old folder left


def test_atomic_dir_leaves_the_target_alone_on_error(tmp_path: Path) -> None:
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("old")
    with pytest.raises(RuntimeError), atomic_dir(target) as tmp:
        (tmp / "half.txt").write_text("half")
        raise RuntimeError("writer failed")
    assert [p.name for p in target.iterdir()] == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_publish_once_keeps_the_first_folder_and_cleans_up(tmp_path: Path) -> None:
    target = tmp_path / "entry"
    publish_once(target, lambda folder: (folder / "a").write_text("first"))
    publish_once(target, lambda folder: (folder / "a").write_text("second"))  # lost the race: dropped
    assert (target / "a").read_text() == "first"
    with pytest.raises(RuntimeError):
        publish_once(tmp_path / "failed", lambda folder: (_ for _ in ()).throw(RuntimeError("export failed")))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]  # no temporary folder left behind
