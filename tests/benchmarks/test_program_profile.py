"""benchmarks/program_profile.py: an ETDump profile of a program's step, grouped by operator."""

import pytest

from benchmarks import program_profile
from tests.utils.programs import TINY_Q4


def test_the_profile_splits_a_step_into_delegate_and_portable_operators(program_factory, capsys):
    """Every group is time inside ``Method::execute`` (nested events, so their sum cannot exceed it), the base
    linears are XNNPACK's fully connected operator, and the noise generator's integer ops run outside it."""
    pte, _ = program_factory(TINY_Q4)
    (profile,) = program_profile.profile_programs([pte], steps=2)
    groups = {key: ms for key, ms in profile.items() if key != "total"}
    assert profile["total"] > 0
    assert sum(groups.values()) <= profile["total"]
    assert any(key.startswith("xnnpack: Fully Connected") for key in groups)
    assert any(key.startswith("portable: bitwise_xor") for key in groups)

    assert program_profile.main(["--programs", str(pte), str(pte), "--steps", "1", "--top", "3"]) == 0
    table = capsys.readouterr().out
    assert "| **whole step (Method::execute)** |" in table and table.count("\n") == 2 + 3 + 3 + 1


def test_an_inference_program_is_profiled_over_the_same_rows_beside_the_step(
    program_factory, inference_program, capsys
):
    """``--inference``: benchmarks.program's plain forward of the base model over the step's 2·batch rows; its
    linears are XNNPACK's too, and it runs none of the step's noise generator."""
    pte, _ = program_factory(TINY_Q4)
    inference, _ = inference_program
    step, plain = program_profile.profile_programs([pte], steps=1, inference=inference)
    assert plain["total"] > 0 and any(key.startswith("xnnpack: Fully Connected") for key in plain)
    assert not any(key.startswith("portable: bitwise_xor") for key in plain)
    assert any(key.startswith("portable: bitwise_xor") for key in step)

    assert program_profile.main(["--programs", str(pte), "--inference", str(inference), "--steps", "1"]) == 0
    assert f"| {pte.stem} | {inference.stem} |" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # a training program is not an inference program
        program_profile.main(["--programs", str(pte), "--inference", str(pte)])
    assert "--inference: not an inference program" in capsys.readouterr().err


def test_a_programs_own_memory_leaves_out_the_measuring_process(program_factory, inference_program, tiny_model_dir):
    """benchmarks.program's memory of a step and of the inference forward of the same rows, each in a fresh
    process: the program's own (the peak over the RSS before loading it) is positive and a small part of the
    process's peak, whose interpreter and torch a device's native runner does not have."""
    import json

    from benchmarks.program import INFERENCE, memory_measured

    pte, manifest = program_factory(TINY_Q4)
    inference, inference_ptd = inference_program
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    ptd = pte.parent / manifest.ptd.file
    step = memory_measured(pte, ptd, manifest.lora_size, TINY_Q4, vocab, "step")
    plain = memory_measured(inference, inference_ptd, None, TINY_Q4, vocab, INFERENCE)
    for row in (step, plain):
        assert 0 < row["program_mb"] < row["run_peak_mb"] / 2, row
