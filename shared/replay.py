"""Replaying a training log (``shared.train_log``): B rebuilt from the initial B and every step's (seed, lr, g).

Because z is a pure function of the step's seed (``shared.noise``) and the update is the same float32 arithmetic
as in the program (``shared.zo.updated_b``), replaying a device's log gives the device's B bit for bit. The
server uses it to verify uploads; anyone can use it to audit a trajectory without the data.
"""

from __future__ import annotations

import torch

from shared.zo import step_noise
from shared.zo_optim import new_state, update


def replay(init_b: torch.Tensor, log: list[dict], optimizer: str = "sgd") -> torch.Tensor:
    """B after every step of ``log``, starting from ``init_b`` (flat float32), moved by ``optimizer``
    (``shared.zo_optim``: its state starts at zero and is rebuilt from the logged g; a log written before there were
    optimizers is an ``sgd`` log)."""
    return replay_state(init_b, log, optimizer)[0]


def replay_state(
    init_b: torch.Tensor, log: list[dict], optimizer: str = "sgd", state: dict[str, torch.Tensor] | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(B, optimizer state) after ``log``, from ``init_b`` and ``state`` (None: the optimizer's initial state)."""
    b = init_b.detach().to(torch.float32).clone()
    state = new_state(optimizer, b.shape[0]) if state is None else state
    with torch.no_grad():
        for record in log:
            g = torch.tensor(record["g"], dtype=torch.float32)
            z = step_noise(torch.tensor([int(record["seed"])]), g.shape[0], b.shape[0])
            b, state = update(optimizer, b, z, g, torch.tensor([record["lr"]], dtype=torch.float32), state)
    return b, state
