"""Replaying a training log (``shared.train_log``): B rebuilt from the initial B and every step's (seed, lr, g).

Because z is a pure function of the step's seed (``shared.noise``) and the update is the same float32 arithmetic
as in the program (``shared.zo.updated_b``), replaying a device's log gives the device's B bit for bit. The
server uses it to verify uploads; anyone can use it to audit a trajectory without the data.
"""

from __future__ import annotations

import torch

from shared.zo import step_noise, updated_b


def replay(init_b: torch.Tensor, log: list[dict]) -> torch.Tensor:
    """B after every step of ``log``, starting from ``init_b`` (flat float32)."""
    b = init_b.detach().to(torch.float32).clone()
    with torch.no_grad():
        for record in log:
            g = torch.tensor(record["g"], dtype=torch.float32)
            z = step_noise(torch.tensor([int(record["seed"])]), g.shape[0], b.shape[0])
            b = updated_b(b, z, g, torch.tensor([record["lr"]], dtype=torch.float32))
    return b
