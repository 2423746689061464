"""The comparison methods: MeZO on LoRA-FA, MeZO on all parameters, first-order SGD on LoRA-FA.

They share the loss (``zo.forward_losses``), the noise and the LoRA layers with MobiZO; what differs is what the
papers compared: MeZO runs the ± passes one after another and perturbs the parameters *in place*, regenerating z
from the seed at each of its four walks (+eps, -2 eps, +eps, update) instead of storing it.
"""

from __future__ import annotations

import torch
from torch import nn

from shared.batch import Batch
from shared.lora import MPLoRA
from shared.zo import forward_losses, path_losses, step_noise


def mezo_lora_step(
    model: nn.Module,
    lora: MPLoRA,
    batch: Batch,
    b: torch.Tensor,
    seed: torch.Tensor,
    lr: torch.Tensor,
    eps: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MeZO on the LoRA-B vector ``b`` (updated in place); q = 1. Returns (losses [2], g [1])."""

    def z() -> torch.Tensor:  # regenerated at each walk, as MeZO does, in B's dtype
        return step_noise(seed, 1, b.shape[0])[0].to(b.dtype)

    b.add_(z() * eps)
    plus = path_losses(model, lora, batch, b[None], copies=1)
    b.sub_(z() * (eps * 2))
    minus = path_losses(model, lora, batch, b[None], copies=1)
    b.add_(z() * eps)
    g = (plus - minus) / (eps * 2)
    b.sub_(z() * (g * lr))
    return torch.cat([plus, minus]), g


def _walk(params: list[nn.Parameter], seed: int, scale: float) -> None:
    """Add ``scale * z`` to every parameter, z regenerated from ``seed`` (MeZO's seed trick)."""
    generator = torch.Generator(device=params[0].device).manual_seed(seed)
    for p in params:
        z = torch.randn(p.shape, generator=generator, device=p.device, dtype=p.dtype)
        p.add_(z, alpha=scale)


def mezo_step(model: nn.Module, batch: Batch, seed: int, lr: float, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """MeZO over all parameters (q = 1). Returns (losses [2], g [1]).

    Uses torch's generator rather than ``shared.noise``: this is the baseline as MeZO wrote it (its z never has to
    be replayed elsewhere), and torch's ``randn`` is what its speed was measured with.
    """
    params = list(model.parameters())
    _walk(params, seed, eps)
    plus = forward_losses(model, batch).mean()
    _walk(params, seed, -2 * eps)
    minus = forward_losses(model, batch).mean()
    _walk(params, seed, eps)
    g = (plus - minus) / (2 * eps)
    _walk(params, seed, -lr * float(g))
    return torch.stack([plus, minus]), g.reshape(1)


def fo_lora_loss_and_grad(
    model: nn.Module, lora: MPLoRA, batch: Batch, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss at ``b`` and its gradient with respect to ``b`` by backpropagation."""
    leaf = b.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        loss = path_losses(model, lora, batch, leaf[None], copies=1)[0]
        loss.backward()
    return loss.detach(), leaf.grad


def fo_lora_step(
    model: nn.Module, lora: MPLoRA, batch: Batch, b: torch.Tensor, lr: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain SGD on the LoRA-B vector (updated in place). Returns (losses [1], gradient norm [1])."""
    loss, grad = fo_lora_loss_and_grad(model, lora, batch, b)
    b.sub_(grad * lr)
    return loss.reshape(1), grad.norm().reshape(1)
