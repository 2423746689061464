"""benchmarks/program_profile.py: an ETDump profile of a program's step, grouped by operator."""

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
