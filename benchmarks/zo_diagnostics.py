"""zo_diagnostics: why does a zeroth-order run stop where it stops? Its estimate against the true gradient, by step.

A MobiZO step moves B by ĝ = (1/q) Σ g_i z_i, g_i = (L_i(B + eps z_i) − L_i(B − eps z_i)) / (2 eps) on query i's
rows. Three things keep ĝ from the batch's true gradient ∇L, and each predicts a different fix:

- **direction sampling**: even with exact directional derivatives ∇L_i·z_i (a JVP), ĝ spans q random directions of
  D, so its cosine with ∇L is about √(q/D): more probes, or fewer coordinates;
- **finite differences**: g_i against the exact ∇L_i·z_i (the smoothing bias of eps and float32's rounding of two
  nearby losses): a better eps or precision;
- **query batches**: each query sees E = batch/q rows, so ∇L_i is a noisy view of ∇L: larger batches.

This script trains a job's coordinates (``shared.train``: the task's defaults, the model's chosen prompt, on the
accuracy benchmark's seeded sample, ``benchmarks.accuracy.sample_task``) and every ``--every`` steps, on that step's
batch and B before the step, measures with backpropagation (one backward pass per query): cos(ĝ, ∇L),
cos(ĝ_exact, ∇L) (the same z with exact derivatives), √(q/D), the finite differences' relative error
‖g − g_exact‖ / ‖g_exact‖, and the mean cos(∇L_i, ∇L). ``--mode`` changes the step itself (same batches, seeds and
lr) to tell which term binds over a run:

- ``zo``: the job's step (finite differences), as the device runs it;
- ``exact``: g_i replaced by the exact ∇L_i·z_i (q backward passes a step): finite differences removed;
- ``oracle``: each direction tilted toward the true gradient, z'_i = √(1−ρ²) z_i + ρ √D ∇L/‖∇L‖ (``--rho``), with
  exact derivatives and the step divided by 1 − ρ² + ρ²D so that its mean is still lr·∇L: what a better-aimed
  direction would buy at the same mean step.

    python -m benchmarks.zo_diagnostics --model models/smollm2 --data-dir DATA --steps 2000 --every 100 \
        --modes zo,exact,oracle --threads 2 --out runs/zo-diagnostics

Each mode's run writes ``OUT/<mode>.json`` (its test accuracy every ``--eval-every`` steps and the diagnostics) when
it ends; a finished mode is not run again. docs/benchmarks/zo_diagnostics.md has the figures and their command.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.accuracy import TASK_FILES, sample_task
from shared.baselines import fo_lora_loss_and_grad
from shared.batch import Batch
from shared.files import atomic_write_bytes
from shared.tasks import task_data_dir
from shared.train import TrainConfig, ZerothOrderOut, _loop, _prepare, validate, with_defaults
from shared.zo import step_noise

MODES = ("zo", "exact", "oracle")


def _rows(batch: Batch, start: int, stop: int) -> Batch:
    """Rows start..stop of ``batch`` (a query's E rows), its candidates and prior kept."""
    cut = [t[start:stop] for t in (batch.input_ids, batch.attention_mask, batch.position_ids, batch.targets)]
    return Batch(*cut, candidates=batch.candidates, prior=batch.prior)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    na, nb = float(a.double().norm()), float(b.double().norm())
    return float(a.double() @ b.double()) / (na * nb) if na and nb else 0.0


def oracle_scale(rho: float, d: int) -> float:
    """E[z' z'ᵀ] = (1−ρ²) I + ρ² D uuᵀ for the tilted direction (u = ∇L/‖∇L‖): the update's mean along ∇L is
    1 − ρ² + ρ² D times the exact one's. Dividing by it keeps the oracle's mean step lr·∇L, as zo's and exact's
    (unbiased, E[z zᵀ] = I), so it differs from them only in how well it is aimed. 1 for ρ = 0."""
    return 1 - rho**2 + rho**2 * d


class DiagnosedStep:
    """The run's ``MethodStep`` in ``mode``, measuring every ``every`` steps. Same interface: ``b``, ``device``,
    ``opt_state``, ``step(batch, seed, lr) -> (losses, g)``."""

    def __init__(self, step, mode: str, every: int, rho: float) -> None:
        self.inner, self.mode, self.every, self.rho = step, mode, every, rho
        self.device, self.opt_state, self.k, self.rows = step.device, step.opt_state, 0, []

    @property
    def b(self) -> torch.Tensor:
        return self.inner.b

    def gradients(self, batch: Batch) -> list[torch.Tensor]:
        """∇L_i at B for each query's rows, by backpropagation."""
        q, per = self.inner.q, batch.input_ids.shape[0] // self.inner.q
        step = self.inner
        return [
            fo_lora_loss_and_grad(step.model, step.lora, _rows(batch, i * per, (i + 1) * per), step.b)[1]
            for i in range(q)
        ]

    def __call__(self, batch: Batch, seed: int, lr: float) -> ZerothOrderOut:
        measure, self.k = self.k % self.every == 0, self.k + 1
        if self.mode == "zo" and not measure:
            return self.inner(batch, seed, lr)
        b, q = self.inner.b, self.inner.q
        grads = self.gradients(batch)
        z = step_noise(torch.tensor([seed]), q, b.shape[0]).to(b.dtype)
        full = torch.stack(grads).mean(dim=0)
        if self.mode == "oracle":
            aim = full / full.norm().clamp_min(1e-30) * math.sqrt(b.shape[0])
            z = math.sqrt(1 - self.rho**2) * z + self.rho * aim
        exact = torch.stack([grads[i] @ z[i] for i in range(q)])
        if self.mode == "zo":
            losses, g = self.inner(batch, seed, lr)
        else:  # the exact derivatives along z (tilted for the oracle), SGD's update, unbiased (``oracle_scale``)
            scale = oracle_scale(self.rho, b.shape[0]) if self.mode == "oracle" else 1.0
            self.inner.b = b - (exact[:, None] * z).sum(dim=0) * (lr / q / scale)
            losses, g = exact.new_zeros(2 * q), exact
        if measure:
            estimate, ideal = (g[:, None] * z).sum(dim=0) / q, (exact[:, None] * z).sum(dim=0) / q
            self.rows.append(
                {
                    "step": self.k - 1,
                    "cos_estimate": cosine(estimate, full),
                    "cos_exact": cosine(ideal, full),
                    "sqrt_q_over_d": math.sqrt(q / b.shape[0]),
                    "fd_relative_error": float((g - exact).double().norm() / exact.double().norm().clamp_min(1e-30)),
                    "cos_query_batch": float(np.mean([cosine(gi, full) for gi in grads])),
                    "grad_norm": float(full.norm()),
                }
            )
            row = self.rows[-1]
            print(
                f"{self.mode}: step {row['step']}: cos(estimate, ∇) {row['cos_estimate']:.4f}, "
                f"finite differences {row['fd_relative_error']:.3f}",
                file=sys.stderr,
                flush=True,
            )
        return ZerothOrderOut(losses, g)


def run_mode(args: argparse.Namespace, files: dict[str, Path], mode: str) -> dict[str, Any]:
    """One run of ``mode`` → its result (test accuracy along the run, the diagnostics, the seconds)."""
    config = with_defaults(
        TrainConfig(
            model=args.model,
            task=args.task,
            train=files["train"],
            eval=files["test"],
            out=args.out / "runs" / mode,
            method="mobizo",
            steps=args.steps,
            eval_every=args.eval_every,
            seed=args.seed,
            device="cpu",
            **({"lr": args.lr} if args.lr is not None else {}),
        )
    )
    run = _prepare(config, validate(config))
    step = DiagnosedStep(run.step, mode, args.every, args.rho)
    run.step = step
    started = time.perf_counter()
    state = _loop(run, progress=False)
    return {
        "mode": mode,
        "config": {k: getattr(config, k) for k in ("q", "batch_size", "rank", "lr", "eps", "lr_schedule", "steps")},
        "d": int(run.step.b.shape[0]),
        "eval": state.history["eval"],
        "diagnostics": step.rows,
        "seconds": time.perf_counter() - started,
        "step_time_s": float(np.median(state.history["times"])),
    }


def _means(rows: list[dict]):
    return lambda key: float(np.mean([row[key] for row in rows])) if rows else float("nan")


def summary(results: list[dict]) -> str:
    lines = [
        "| mode | test accuracy: start → end | cos(estimate, ∇) | cos(exact along z, ∇) | √(q/D) | "
        "finite-difference error | cos(query ∇, batch ∇) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        mean = _means(r["diagnostics"])
        acc = f"{r['eval'][0]['accuracy']:.3f} → {r['eval'][-1]['accuracy']:.3f}"
        lines.append(
            f"| {r['mode']} | {acc} | {mean('cos_estimate'):.4f} | {mean('cos_exact'):.4f} | "
            f"{mean('sqrt_q_over_d'):.4f} | {mean('fd_relative_error'):.3f} | {mean('cos_query_batch'):.3f} |"
        )
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--task", default="sst2", choices=sorted(TASK_FILES))
    p.add_argument("--data-dir", type=Path, help="task data (default: the shipped samples)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=20, help="measure every this many steps")
    p.add_argument("--eval-every", type=int, default=100, help="test accuracy every this many steps")
    p.add_argument("--modes", default="zo,exact,oracle")
    p.add_argument("--rho", type=float, default=0.1, help="the oracle's tilt toward the true gradient")
    p.add_argument("--lr", type=float, help="the peak learning rate (default: the job's for the task)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-train", type=int, default=1000)
    p.add_argument("--n-val", type=int, default=500)
    p.add_argument("--n-test", type=int, default=1000)
    p.add_argument("--sample-seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        p.error(f"argument --modes: unknown {', '.join(unknown)} (choose from {', '.join(MODES)})")
    if args.steps < 1 or args.every < 1 or args.eval_every < 1:
        p.error("argument --steps: --steps, --every and --eval-every must be at least 1")
    if args.lr is not None and not args.lr > 0:
        p.error("argument --lr: must be positive")
    if not 0 <= args.rho < 1:
        p.error("argument --rho: must be in [0, 1)")
    args.modes = modes
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    files = sample_task(args.task, args.data_dir or task_data_dir(), args.out, args)
    results = []
    for mode in args.modes:
        path = args.out / f"{mode}.json"
        if not path.exists():
            print(f"{mode}: {args.steps} steps", file=sys.stderr, flush=True)
            atomic_write_bytes(path, json.dumps(run_mode(args, files, mode), indent=1).encode())
        results.append(json.loads(path.read_text()))
    text = summary(results)
    print(text)
    atomic_write_bytes(args.out / "zo_diagnostics.md", (text + "\n").encode())
    return results


if __name__ == "__main__":
    main()
