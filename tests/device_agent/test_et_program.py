"""ProgramSession: the program's methods around one shared B, as the executorch backend uses them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from device_agent.batches import BatchesFile
from device_agent.et_program import ProgramSession
from tests.device_agent.helpers import Program


@pytest.mark.slow  # uses the session's program export
def test_set_then_get_b_and_training_moves_it(tiny_program: Program, make_batches: Callable[..., Path]) -> None:
    session = ProgramSession(*tiny_program.files)
    b0 = session.get_b()
    assert b0.dtype == np.float32 and b0.size == tiny_program.d  # its values: unset until set_lora_b
    wanted = np.linspace(-1, 1, b0.size, dtype=np.float32)
    session.set_b(wanted)
    assert session.get_b().tobytes() == wanted.tobytes()
    losses, g = session.step(BatchesFile(make_batches(1))[0], 0.05, 0.01)
    assert (losses.shape, g.shape) == ((8,), (4,))  # 2q losses, q projected gradients (q = 4)
    np.testing.assert_allclose(g, (losses[0::2] - losses[1::2]) / (2 * np.float32(0.01)), rtol=1e-5)
    assert not np.array_equal(session.get_b(), wanted)


def test_a_program_without_the_training_methods_is_refused(tmp_path: Path) -> None:
    import torch
    from executorch.exir import to_edge

    class Plain(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

    program = to_edge(torch.export.export(Plain(), (torch.ones(2),))).to_executorch()
    (tmp_path / "plain.pte").write_bytes(program.buffer)
    with pytest.raises(ValueError, match="get_lora_b"):
        ProgramSession(tmp_path / "plain.pte", None)


@pytest.mark.slow  # uses the session's program export
def test_a_training_session_steps_as_a_full_one_and_refuses_evaluate(
    tiny_program: Program, make_batches: Callable[..., Path]
) -> None:
    """Without ``evaluate`` loaded (the executorch backend's session), B and the step are bit for bit those of a
    session with every method; asking it to evaluate is an error, not a silent reset of B."""
    batch = BatchesFile(make_batches(1))[0]
    b = np.linspace(-1, 1, tiny_program.d, dtype=np.float32)
    results = []
    for evaluate in (True, False):
        session = ProgramSession(*tiny_program.files, evaluate=evaluate)
        session.set_b(b)
        losses, g = session.step(batch, 0.05, 0.01)
        results.append((losses.tobytes(), g.tobytes(), session.get_b().tobytes()))
    assert results[0] == results[1]
    rows = np.zeros((8, 16), np.int64)
    with pytest.raises(RuntimeError, match="training only"):
        session.evaluate(rows, rows, rows[:, :2])


@pytest.mark.slow  # uses the session's program export
def test_an_agent_process_runs_a_program_without_importing_the_exporter(tiny_program: Program) -> None:
    """``device_agent.et_runtime``: a process that only runs programs never imports ``executorch.exir`` (the whole
    exporter, seconds at every agent start), runs the program all the same, and can still import the exporter
    afterwards."""
    import subprocess
    import sys

    script = """
import sys
import numpy as np
from device_agent.et_program import ProgramSession
session = ProgramSession(sys.argv[1], sys.argv[2])
session.set_b(np.full(int(sys.argv[3]), 0.25, dtype=np.float32))
assert (session.get_b() == np.float32(0.25)).all()
print(sorted(m for m in sys.modules if m.startswith("executorch.exir")))
import executorch.exir
print(executorch.exir.EdgeCompileConfig.__name__)
"""
    pte, ptd = tiny_program.files
    run = subprocess.run(
        [sys.executable, "-c", script, str(pte), str(ptd), str(tiny_program.d)], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["['executorch.exir._warnings']", "EdgeCompileConfig"]
