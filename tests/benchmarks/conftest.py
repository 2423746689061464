"""Fixtures of the benchmark scripts' tests."""

from pathlib import Path

import pytest

from tests.utils.programs import TINY_Q4


@pytest.fixture(scope="session")
def inference_program(tiny_model_dir, tmp_path_factory):
    """``(pte, ptd)``: benchmarks.program's plain forward of the tiny model over the 2·batch rows of a ``TINY_Q4``
    step, and its weights file, where the benchmarks keep it (``benchmarks.program.program_path``: a run given
    its folder reuses it)."""
    from benchmarks.program import INFERENCE, _export_child, program_path

    inference = program_path(tmp_path_factory.mktemp("inference"), TINY_Q4, INFERENCE)

    class Sink(list):
        put = list.append

    sink = Sink()
    _export_child(str(tiny_model_dir), TINY_Q4, str(inference), INFERENCE, sink)
    return inference, Path(sink[0]["ptd"])
