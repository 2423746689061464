"""The benchmarks that draw more rows than the samples shipped in data/ hold stop before they train, naming the flag
and the variable that point them at the full task data; draws that fit run on the samples."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks.accuracy import check_pools
from benchmarks.federation import _shards
from shared.tasks import SAMPLES_DIR


def test_accuracy_refuses_the_papers_draw_from_the_samples() -> None:
    args = argparse.Namespace(n_train=1000, n_val=500)
    check_pools(SAMPLES_DIR, ["sst2"], args)  # 2,000 SST-2 training examples: enough
    for task in ("rte", "boolq"):
        with pytest.raises(
            SystemExit, match=rf"{task}: .* holds \d+ examples.*--data-dir DIR or \$MOBIZO_TASK_DATA_DIR"
        ):
            check_pools(SAMPLES_DIR, [task], args)
    check_pools(SAMPLES_DIR, ["rte", "boolq"], argparse.Namespace(n_train=100, n_val=50))


def test_accuracy_names_a_missing_pool(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no .*sst2/train.jsonl; name the task data with --data-dir"):
        check_pools(tmp_path, ["sst2"], argparse.Namespace(n_train=10, n_val=5))


def test_federation_shards_fit_or_name_the_flag(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"need 1600 SST-2 rows of label 0; .* has \d+: name .*--data-dir DIR"):
        _shards(SAMPLES_DIR, 8, 400, 0.9, tmp_path)  # the benchmark's defaults
    shards = _shards(SAMPLES_DIR, 4, 100, 0.9, tmp_path)
    rows = [[json.loads(line) for line in path.read_text().splitlines()] for path in shards]
    assert [sum(r["label"] == i % 2 for r in shard) for i, shard in enumerate(rows)] == [90] * 4
    assert len({json.dumps(r) for shard in rows for r in shard}) == 400  # disjoint
