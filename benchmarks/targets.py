"""Which linear layers should a zeroth-order LoRA-FA job train? Each kind's share of the gradient against its share
of the curvature, and the progress a ZO step can make on each set of kinds.

A ZO step with q queries moves B by ``-(lr / q) sum_i g_i z_i``, ``g_i = z_i . grad_b`` (grad_b: the batch's
gradient). To second order, its expected decrease of the loss is ``lr |G|^2 - lr^2 / (2q) E|grad_b|^2 tr(H)``
(G: the mean gradient over the data, H: the Hessian; the z_i have unit variance), so the best lr is
``q |G|^2 / (E|grad_b|^2 tr H)`` and the best step lowers the loss by ``q |G|^4 / (2 E|grad_b|^2 tr H)``: the
**rate** of a set of coordinates. Unlike first-order training, every coordinate a ZO step perturbs costs it
(through tr H), whether or not it carries gradient; a set of layers whose gradient is large next to its curvature
learns faster, even with fewer coordinates. With a frozen random A, |G|^2, E|grad_b|^2 and tr H all grow in
proportion to the rank, so the rate of a set does not depend on the rank, only its capacity does.

The script measures, for every target kind (``--targets``, LoRA-FA of ``--rank`` on every layer of that kind) at
B = 0 on the task's training rows: D (coordinates), |G|^2 (the gradient of the mean loss over ``--n-examples``
rows), E|grad_b|^2 (over batches of ``--batch-size``), tr H (Hutchinson: ``--probes`` Rademacher vectors per
kind, each on that kind's coordinates, exact Hessian-vector products by double backpropagation; ± one standard
error), then each set of ``--sets`` (the sums over its kinds) with its rate and best lr relative to the first set.
The figures hold at B = 0, so they predict a job's first steps; ``benchmarks/accuracy.py --targets`` trains the
sets to see what follows (docs/benchmarks/targets.md).

    python -m benchmarks.targets --model models/smollm2 --task sst2 --n-examples 256 --probes 32 --threads 2 \\
        --sets q_proj,v_proj v_proj down_proj up_proj up_proj,down_proj
    python -m benchmarks.targets --n-examples 32 --probes 4     # the tiny model, a fresh seeded one
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from shared import defaults
from shared.batch import Batch
from shared.data import encode, load_examples, pad_token_id, single_token_candidates, training_batch
from shared.hf_models import load_model
from shared.lora import MPLoRA, inject_lora
from shared.tasks import get_task, task_data_dir
from shared.zo import path_losses

KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Kind:
    """One set of coordinates' measurements at B = 0 (sums over its coordinates)."""

    name: str
    size: int  # D
    grad_sq: float  # |G|^2, G the gradient of the mean loss over the examples
    batch_grad_sq: float  # E|grad_b|^2 over the batches
    trace: float  # tr H, Hutchinson estimate
    trace_se: float  # its standard error

    def __add__(self, other: Kind) -> Kind:
        return Kind(
            f"{self.name},{other.name}",
            self.size + other.size,
            self.grad_sq + other.grad_sq,
            self.batch_grad_sq + other.batch_grad_sq,
            self.trace + other.trace,
            math.hypot(self.trace_se, other.trace_se),
        )

    @property
    def best_lr(self) -> float:
        """q |G|^2 / (E|grad_b|^2 tr H) at q = 1 (a relative figure: the ZO step's lr in these units)."""
        return self.grad_sq / (self.batch_grad_sq * self.trace) if self.trace > 0 else math.nan

    @property
    def rate(self) -> float:
        """|G|^4 / (E|grad_b|^2 tr H): the loss decrease of the best step, up to the factor q / 2."""
        return self.grad_sq * self.best_lr


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--model", type=Path, help="Hugging Face model folder (default: a fresh seeded tiny model)")
    add("--task", default="sst2", help="a classification task with single-token answers")
    add("--data", type=Path, help="training rows (default: the task's train.jsonl in the task data)")
    add("--targets", default=",".join(KINDS), help="comma-separated linear kinds to measure")
    add("--sets", nargs="+", help="comma-separated sets of kinds to compare (default: the defaults', then each kind)")
    add("--rank", type=int, default=defaults.CLASSIFICATION.rank, help="LoRA rank of every kind")
    add("--n-examples", type=int, default=256, help="rows of the mean gradient")
    add("--batch-size", type=int, default=16, help="rows of one step's batch")
    add("--probes", type=int, default=32, help="Hutchinson probes per kind (spread over the batches)")
    add("--seq-len", type=int, default=defaults.SEQ_LEN, help="cut prompts from the left to this many tokens")
    add("--seed", type=int, default=0, help="seeds the probes")
    add("--threads", type=int, help="torch CPU threads")
    add("--json-out", type=Path, help="write the table as JSON here")
    return parser.parse_args(argv)


def batches(args: argparse.Namespace, tokenizer) -> list[Batch]:
    """The first ``--n-examples`` training rows as batches of ``--batch-size``, with the task's candidates."""
    task = get_task(args.task)
    candidates = single_token_candidates(task, tokenizer)
    if candidates is None:
        raise SystemExit(f"--task {args.task}: needs single-token candidates (the classification objective)")
    path = args.data or task_data_dir() / args.task / "train.jsonl"
    rows = encode(load_examples(task, path, limit=args.n_examples), tokenizer, args.seq_len)
    ids = torch.tensor(candidates, dtype=torch.long)
    pad = pad_token_id(tokenizer)
    size = args.batch_size
    return [replace(training_batch(rows[i : i + size], pad), candidates=ids) for i in range(0, len(rows), size)]


def masks(lora: MPLoRA) -> dict[str, torch.Tensor]:
    """Each kind's coordinates of the flat B (a boolean mask)."""
    found: dict[str, torch.Tensor] = {}
    for module in lora.modules:
        kind = module.name.rsplit(".", 1)[-1]
        mask = found.setdefault(kind, torch.zeros(lora.size, dtype=torch.bool))
        mask[module.offset : module.offset + module.numel(lora.rank)] = True
    return found


def loss_at(model, lora: MPLoRA, batch: Batch, b: torch.Tensor) -> torch.Tensor:
    """The batch's mean loss with every LoRA layer at ``b`` (differentiable in ``b``)."""
    return path_losses(model, lora, batch, b[None], copies=1)[0]


def measure(model, lora: MPLoRA, data: list[Batch], probes: int, seed: int) -> list[Kind]:
    """Every kind's |G|^2, E|grad_b|^2 and Hutchinson tr H at B = 0: ``probes`` Rademacher vectors per kind, each
    nonzero on that kind's coordinates only (a probe spread over every kind would add the cross-kind blocks of H
    to each kind's variance), spread over the batches."""
    zero = lora.zeros()
    kind_masks = masks(lora)
    total, squares, rows = torch.zeros_like(zero), torch.zeros_like(zero), 0
    samples: dict[str, list[float]] = {name: [] for name in kind_masks}  # z^T H z of each probe
    generator = torch.Generator().manual_seed(seed)
    per_batch = [probes // len(data) + (i < probes % len(data)) for i in range(len(data))]
    for batch, count in zip(data, per_batch):
        leaf = zero.clone().requires_grad_(True)
        with torch.enable_grad():
            (grad,) = torch.autograd.grad(loss_at(model, lora, batch, leaf), leaf, create_graph=count > 0)
            todo = [(name, mask) for _ in range(count) for name, mask in kind_masks.items()]
            for k, (name, mask) in enumerate(todo):
                z = (torch.randint(0, 2, zero.shape, generator=generator).to(zero.dtype) * 2 - 1) * mask
                (hz,) = torch.autograd.grad(grad @ z, leaf, retain_graph=k + 1 < len(todo))
                samples[name].append(float((z.double() * hz.double()).sum()))
        n = batch.input_ids.shape[0]
        grad = grad.detach()
        total += grad * n
        squares += grad * grad
        rows += n
    mean = total / rows
    kinds = []
    for name, mask in kind_masks.items():
        values = torch.tensor(samples[name], dtype=torch.float64)
        se = float(values.std() / math.sqrt(len(values))) if len(values) > 1 else math.nan
        kinds.append(
            Kind(
                name,
                int(mask.sum()),
                float(mean[mask].double().pow(2).sum()),
                float(squares[mask].double().sum() / len(data)),
                float(values.mean()),
                se,
            )
        )
    return kinds


def combine(kinds: dict[str, Kind], names: str) -> Kind:
    unknown = [n for n in names.split(",") if n not in kinds]
    if unknown:
        raise SystemExit(f"--sets: {', '.join(unknown)} not measured (--targets {','.join(kinds)})")
    chosen = [kinds[n] for n in names.split(",")]
    total = chosen[0]
    for kind in chosen[1:]:
        total = total + kind
    return total


def table(kinds: list[Kind], sets: list[Kind]) -> str:
    head = "| {} | D | \\|G\\|² | E\\|grad_b\\|² | tr H (± s.e.) | best lr (rel.) | rate (rel.) |"
    head += "\n|---|---:|---:|---:|---:|---:|---:|"
    base = sets[0]
    lines = [head.format("kind")]
    for kind in kinds:
        lines.append(_row(kind, base))
    lines += ["", head.format("set")]
    lines += [_row(s, base) for s in sets]
    return "\n".join(lines)


def _row(kind: Kind, base: Kind) -> str:
    return (
        f"| {kind.name} | {kind.size:,} | {kind.grad_sq:.3g} | {kind.batch_grad_sq:.3g} | {kind.trace:.3g} "
        f"(± {kind.trace_se:.2g}) | {kind.best_lr / base.best_lr:.2f} | {kind.rate / base.rate:.2f} |"
    )


def _record(kind: Kind) -> dict:
    return {**kind.__dict__, "best_lr": kind.best_lr, "rate": kind.rate}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    targets = tuple(t for t in args.targets.split(",") if t)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from shared.tiny_model import make_tiny_model

            model_dir = make_tiny_model(Path(tmp) / "tiny", seed=0)
        model, tokenizer = load_model(model_dir)
    lora = inject_lora(model, targets, args.rank, defaults.alpha_for(args.rank), defaults.A_SEED)
    kinds = measure(model, lora, batches(args, tokenizer), args.probes, args.seed)
    by_name = {k.name: k for k in kinds}
    default_set = ",".join(defaults.TARGETS) if set(defaults.TARGETS) <= set(by_name) else kinds[0].name
    names = args.sets or [default_set, *by_name]
    sets = [combine(by_name, names_) for names_ in names]
    print(table(kinds, sets))
    if args.json_out:
        from shared.files import atomic_write_bytes

        rows = {"kinds": [_record(k) for k in kinds], "sets": [_record(s) for s in sets]}
        atomic_write_bytes(args.json_out, json.dumps(rows, indent=2).encode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
