"""The export pipeline's own invariants (``shared.lowering``), on a module small enough to export in seconds."""

import contextlib

import torch
from torch import nn

from shared import lowering


class Interleaved(nn.Module):
    """Frozen linears separated by an operator XNNPACK does not take (``cumsum``): three partitions of one method,
    so carving partitions out of a graph and the passes' provenance both run."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second, self.third = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        x = self.first(x).cumsum(-1)
        x = self.second(x).cumsum(-1)
        return self.third(x).relu()


def _program(bookkeeping) -> tuple[bytes, int]:
    methods = {"forward": ((torch.randn(2, 8),), None)}
    programs = lowering.trace(Interleaved(), methods, "xnnpack", lowering.frozen_weights_tag, tag_computed=False)
    manager = lowering.emit(
        lowering.to_edge(programs, "xnnpack", bookkeeping), lowering.frozen_weights_tag, (), bookkeeping
    )
    (plan,) = manager.executorch_program.execution_plan
    delegates = sum(type(i.instr_args).__name__ == "DelegateCall" for i in plan.chains[0].instructions)
    return manager.buffer, delegates


def test_the_bookkeeping_cuts_leave_the_program_byte_identical() -> None:
    """``less_bookkeeping`` changes how the edge stages keep their records (lazy graph-module code, shared
    provenance), never what they emit: a torch upgrade that breaks that shows here as different bytes."""
    from torch.fx.traceback import NodeSource

    make_source = NodeSource.__init__
    shipped, delegates = _program(lowering.less_bookkeeping)
    assert NodeSource.__init__ is make_source  # put back after the lowering
    plain, plain_delegates = _program(contextlib.nullcontext)
    assert delegates == plain_delegates == 3
    assert shipped == plain
