"""MP-LoRA: LoRA-FA layers that carry ``n`` copies of B at once (the one home of the MP-LoRA math).

Each target ``nn.Linear`` becomes ``y = x W^T + scaling * (x A^T) B_j^T`` where the batch is ``n`` paths laid end
to end (rows ``j*E .. (j+1)*E-1`` are path j). W and A are shared by all paths and read once; only the small
per-path B_j differ, so running the 2q perturbed copies of a ZO step costs one pass over the weights.

A is frozen and regenerated from a seed (PEFT's kaiming-uniform init); B is not owned by the layers: the trainer
keeps the master B as one flat float32 vector (``MPLoRA.size`` elements, modules in natural name order
(``layout_order``), each ``[out, r]`` row-major, PEFT's ``lora_B.weight`` layout) and hands each forward the paths
it should run with ``MPLoRA.apply``. ``apply(None)`` makes every layer its plain base layer again (B = 0, exactly).
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from shared import defaults
from shared.errors import UsageError
from shared.manifest import LoRAModule


def layout_order(names) -> list[str]:
    """The canonical module order of the flat B vector: natural sort of the names (layers.2 before layers.10).

    Derivable from the names alone, so an adapter file or a manifest fixes the layout without the model.
    """
    return sorted(names, key=lambda n: [int(p) if p.isdigit() else p for p in n.split(".")])


def flatten_b(b_by_name: dict[str, torch.Tensor]) -> torch.Tensor:
    """{module: B [out, r]} → the flat float32 B vector (modules in ``layout_order``)."""
    return torch.cat([b_by_name[n].reshape(-1).to(torch.float32) for n in layout_order(b_by_name)])


def join_b(b_by_name: dict[str, torch.Tensor], shapes: dict[str, tuple[int, int]]) -> torch.Tensor:
    """:func:`flatten_b` of B's whose names and shapes must be exactly ``shapes``; ``ValueError`` naming the first
    differences otherwise."""
    got = {n: tuple(t.shape) for n, t in b_by_name.items()}
    if got != shapes:
        wrong = sorted(set(got.items()) ^ set(shapes.items()))[:3]
        raise ValueError(f"LoRA-B tensors do not match the model's LoRA modules (first differences: {wrong})")
    return flatten_b(b_by_name)


def unflatten_b(b_flat: torch.Tensor, shapes: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`flatten_b` for modules of the given shapes."""
    names = layout_order(shapes)
    sizes = [shapes[n][0] * shapes[n][1] for n in names]
    if sum(sizes) != b_flat.numel():
        raise ValueError(f"flat B has {b_flat.numel()} values, the layout needs {sum(sizes)}")
    return {n: piece.reshape(shapes[n]) for n, piece in zip(names, torch.split(b_flat, sizes))}


def lora_a_init(a_seed: int, name: str, rank: int, in_features: int) -> torch.Tensor:
    """A [rank, in_features] for module ``name``: PEFT's kaiming_uniform(a=sqrt(5)), i.e. U(±1/sqrt(in)), seeded.

    Seeded per (a_seed, module name) so the server can rebuild A for any module without the model.
    """
    # torch's CPU generator keeps only 32 bits of its seed, so fold (a_seed, name) into 32 bits.
    generator = torch.Generator().manual_seed(zlib.crc32(f"{a_seed}:{name}".encode()))
    bound = 1.0 / math.sqrt(in_features)
    return (torch.rand(rank, in_features, generator=generator) * 2.0 - 1.0) * bound


class MPLoRALinear(nn.Module):
    """A frozen linear layer plus a LoRA-FA term with one B per path."""

    def __init__(self, base_layer: nn.Linear, lora_a: torch.Tensor, alpha: float) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.register_buffer("lora_A", lora_a.to(base_layer.weight.dtype))
        self.rank = lora_a.shape[0]
        self.scaling = alpha / self.rank
        self.paths: torch.Tensor | None = None  # [n, out, rank], set by MPLoRA.apply

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        if self.paths is None:
            return y
        n = self.paths.shape[0]
        h = nn.functional.linear(x, self.lora_A).reshape(n, -1, self.rank)
        delta = torch.bmm(h, self.paths.transpose(1, 2).to(h.dtype))
        return y + delta.reshape(y.shape) * self.scaling


class MPLoRA:
    """The injected layers of one model and the layout of the flat master-B vector."""

    def __init__(self, layers: dict[str, MPLoRALinear], rank: int, alpha: float, targets: tuple[str, ...]) -> None:
        self.layers = layers
        self.rank, self.alpha, self.targets = rank, alpha, targets
        self.modules: list[LoRAModule] = []
        offset = 0
        for name, layer in layers.items():
            base = layer.base_layer
            self.modules.append(
                LoRAModule(name=name, in_features=base.in_features, out_features=base.out_features, offset=offset)
            )
            offset += base.out_features * rank
        self.size = offset

    def apply(self, paths: torch.Tensor | None) -> None:
        """Make every layer run the ``n`` paths of ``paths`` [n, size] (None: base model, B = 0)."""
        for module, layer in zip(self.modules, self.layers.values()):
            if paths is None:
                layer.paths = None
                continue
            piece = paths[:, module.offset : module.offset + module.numel(self.rank)]
            layer.paths = piece.reshape(paths.shape[0], module.out_features, self.rank)

    def shapes(self) -> dict[str, tuple[int, int]]:
        return {m.name: (m.out_features, self.rank) for m in self.modules}

    def split(self, b_flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Flat B → {module name: B [out, r]} (views)."""
        return unflatten_b(b_flat, self.shapes())

    def join(self, b_by_name: dict[str, torch.Tensor]) -> torch.Tensor:
        """{module name: B [out, r]} → flat B; names and shapes must match exactly."""
        return join_b(b_by_name, self.shapes())

    def lora_a(self) -> dict[str, torch.Tensor]:
        return {name: layer.lora_A for name, layer in self.layers.items()}

    def zeros(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A zero master B: float32, or float64 for a float64 model (eager exactness checks)."""
        return torch.zeros(self.size, dtype=dtype, device=self.device)

    @property
    def device(self) -> torch.device:
        return next(iter(self.layers.values())).lora_A.device


def inject_lora(
    model: nn.Module,
    targets: tuple[str, ...] = defaults.TARGETS,
    rank: int = defaults.RANK,
    alpha: float = defaults.ALPHA,
    a_seed: int = defaults.A_SEED,
) -> MPLoRA:
    """Wrap every ``nn.Linear`` whose last name part is in ``targets`` with :class:`MPLoRALinear` (in place)."""
    if rank < 1:
        raise UsageError("rank", f"must be >= 1 (got {rank})")
    found: dict[str, nn.Linear] = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets
    }
    missing = [t for t in targets if not any(n.rsplit(".", 1)[-1] == t for n in found)]
    if missing:
        raise UsageError("targets", f"no linear module named {', '.join(missing)} in this model")
    layers: dict[str, MPLoRALinear] = {}
    for name in layout_order(found):
        base = found[name]
        lora_a = lora_a_init(a_seed, name, rank, base.in_features).to(base.weight.device)
        layer = MPLoRALinear(base, lora_a, alpha)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, layer)
        layers[name] = layer
    return MPLoRA(layers, rank, alpha, tuple(targets))
