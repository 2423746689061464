"""What does padding cost a step? One program, the same SST-2 batches, at ``seq_len`` and at each batch's longest row.

A program takes any number of columns from its narrowest to ``seq_len`` (``ProgramInputs.widths``); a device runs
each batch at its longest row (``device_agent.batches.fit_width``). This runs one exported program over the same
steps of real SST-2 rows (the first 2,000 of the train split, batched as the agent batches them) both ways, in
interleaved rounds (full, fitted, fitted, full, ...), and prints the median step time of each, the speed-up, the
columns a fitted step ran at (mean and range), and how closely the two ways' losses agree (each step from the same
B; within float32 rounding, as the cut columns are padding in every row).

    mobizo export --model runs/smollm2 --task sst2 --q 4 --batch-size 16 --seq-len 64 --out runs/pad/p.pte
    python -m benchmarks.padding --program runs/pad/p.pte --steps 20 --repeats 3
    python -m benchmarks.padding --steps 20        # the tiny model, exported into a temporary folder
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.agent import EPS, LR, program, sst2_batches
from device_agent.batches import fit_width
from device_agent.et_program import ProgramSession


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--program", type=Path, help="an exported program (FILE.pte, store beside it); else exported")
    parser.add_argument("--model", type=Path, help="model to export (default: a fresh tiny model)")
    parser.add_argument("--q", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20, help="steps per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each way (interleaved)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    return parser.parse_args()


def run(session: ProgramSession, batches: list, b0: np.ndarray) -> tuple[list[float], list[np.ndarray]]:
    """Per-step seconds and losses of each batch's step from ``b0`` (the same B for both ways at every step: two
    free-running trajectories drift apart from rounding alone)."""
    seconds, losses = [], []
    for batch in batches:
        session.set_b(b0)
        began = time.perf_counter()
        step_losses, _ = session.step(batch, float(np.float32(LR)), float(np.float32(EPS)))
        seconds.append(time.perf_counter() - began)
        losses.append(step_losses)
    return seconds, losses


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        pte, manifest = program(args, folder)
        batches = sst2_batches(manifest, pte.parent / manifest.tokenizer.file, args.steps, folder)
        widths = manifest.inputs.widths
        if widths is None:
            raise SystemExit(f"{pte}: a program of one width (format {manifest.format}): nothing to compare")
        ptd = pte.parent / manifest.ptd.file
        sessions = {
            "full": ProgramSession(pte, ptd, evaluate=False),
            "fitted": ProgramSession(pte, ptd, evaluate=False, widths=widths),
        }
        b0 = np.zeros(manifest.lora_size, np.float32)
        run(sessions["fitted"], batches[:2], b0)  # warm-up
        times: dict[str, list[float]] = {"full": [], "fitted": []}
        losses: dict[str, list[np.ndarray]] = {}
        for i in range(args.repeats):
            for way in ("full", "fitted")[:: 1 if i % 2 == 0 else -1]:
                seconds, losses[way] = run(sessions[way], batches, b0)
                times[way] += seconds
    columns = [fit_width(b.input_ids, b.attention_mask, widths)[0].shape[1] for b in batches]
    full, fitted = (statistics.median(times[way]) for way in ("full", "fitted"))
    worst = max(float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30)) for a, b in zip(*losses.values()))
    result = {
        "program": str(args.program or args.model or "tiny"),
        "config": manifest.config.model_dump(mode="json"),
        "widths": list(widths),
        "steps": args.steps,
        "repeats": args.repeats,
        "full_step_s": full,
        "fitted_step_s": fitted,
        "speedup": full / fitted,
        "fitted_columns_mean": statistics.mean(columns),
        "fitted_columns_range": [min(columns), max(columns)],
        "losses_max_rel_diff": worst,
    }
    print(f"{'way':8} {'columns':>12} {'median step s':>14}")
    print(f"{'full':8} {manifest.config.seq_len:>12} {full:>14.3f}")
    span = f"{min(columns)}-{max(columns)}"
    print(f"{'fitted':8} {span:>12} {fitted:>14.3f}")
    mean = statistics.mean(columns)
    print(f"speed-up {full / fitted:.2f}x; fitted columns mean {mean:.1f}; losses agree to {worst:.1e} (relative)")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
