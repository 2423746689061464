"""What does padding cost a step? One program, the same SST-2 batches, at ``seq_len`` and at each batch's longest row.

A program takes any number of columns from its narrowest to ``seq_len`` (``ProgramInputs.widths``); a device runs
each batch at its longest row (``device_agent.batches.fit_width``). This runs one exported program over the same
steps of real SST-2 rows (the first 2,000 of the train split, batched as the agent batches them) both ways, in
interleaved rounds (full, fitted, fitted, full, ...), and prints the median step time of each, the speed-up, the
columns a fitted step ran at (mean and range), and how closely the two ways' losses agree (each step from the same
B; within float32 rounding, as the cut columns are padding in every row).

``--baseline FILE.pte`` adds a third way: another program of the same config, run at ``seq_len`` in the same
rounds (``benchmarks.export_time --keep``'s ``sdpa.pte`` is the step as it was before the additive mask and the
fitted width: Hugging Face's layers, torch's SDPA, every row at ``seq_len``). The table then gives what a step of
today's program at its batch's longest row costs against that baseline. Where the two take the same steps (float32
programs agree to rounding; the agreement of their losses is printed), a job pays that ratio in device-seconds.

    mobizo export --model runs/smollm2 --task sst2 --q 4 --batch-size 16 --seq-len 64 --out runs/pad/p.pte
    python -m benchmarks.padding --program runs/pad/p.pte --steps 20 --repeats 3
    python -m benchmarks.padding --steps 20        # the tiny model, exported into a temporary folder
    python -m benchmarks.export_time --model runs/smollm2 --variants shipped sdpa --keep runs/exp
    python -m benchmarks.padding --program runs/exp/shipped.pte --baseline runs/exp/sdpa.pte --steps 12 --repeats 2
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
from shared.files import atomic_write_bytes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--program", type=Path, help="an exported program (FILE.pte, store beside it); else exported")
    parser.add_argument("--model", type=Path, help="model to export (default: a fresh tiny model)")
    parser.add_argument("--q", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20, help="steps per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each way (interleaved)")
    parser.add_argument("--baseline", type=Path, help="another program of the same config, run at seq_len as well")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    return parser.parse_args(argv)


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


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
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
        if args.baseline is not None:
            sessions["baseline"] = baseline_session(args.baseline, manifest)
        ways = list(sessions)
        b0 = np.zeros(manifest.lora_size, np.float32)
        run(sessions["fitted"], batches[:2], b0)  # warm-up
        times: dict[str, list[float]] = {way: [] for way in ways}
        losses: dict[str, list[np.ndarray]] = {}
        for i in range(args.repeats):
            for way in ways[:: 1 if i % 2 == 0 else -1]:
                seconds, losses[way] = run(sessions[way], batches, b0)
                times[way] += seconds
    columns = [fit_width(b.input_ids, b.attention_mask, widths)[0].shape[1] for b in batches]
    median = {way: statistics.median(times[way]) for way in ways}
    full, fitted = median["full"], median["fitted"]
    worst = {way: max_rel_diff(losses["full"], losses[way]) for way in ways if way != "full"}
    result = {
        "program": str(args.program or args.model or "tiny"),
        "baseline": None if args.baseline is None else str(args.baseline),
        "config": manifest.config.model_dump(mode="json"),
        "widths": list(widths),
        "steps": args.steps,
        "repeats": args.repeats,
        "full_step_s": full,
        "fitted_step_s": fitted,
        "baseline_step_s": median.get("baseline"),
        "speedup": full / fitted,
        "fitted_columns_mean": statistics.mean(columns),
        "fitted_columns_range": [min(columns), max(columns)],
        "losses_max_rel_diff": worst["fitted"],
        "baseline_losses_max_rel_diff": worst.get("baseline"),
    }
    print(f"{'way':8} {'columns':>12} {'median step s':>14}")
    print(f"{'full':8} {manifest.config.seq_len:>12} {full:>14.3f}")
    span = f"{min(columns)}-{max(columns)}"
    print(f"{'fitted':8} {span:>12} {fitted:>14.3f}")
    mean = statistics.mean(columns)
    agree = worst["fitted"]
    print(f"speed-up {full / fitted:.2f}x; fitted columns mean {mean:.1f}; losses agree to {agree:.1e} (relative)")
    if "baseline" in median:
        base = median["baseline"]
        print(f"{'baseline':8} {manifest.config.seq_len:>12} {base:>14.3f}")
        print(
            f"fitted against the baseline: {base / fitted:.2f}x; the baseline's losses agree with full's to "
            f"{worst['baseline']:.1e} (relative)"
        )
    if args.out:
        atomic_write_bytes(args.out, (json.dumps(result, indent=2) + "\n").encode())


def max_rel_diff(reference: list[np.ndarray], other: list[np.ndarray]) -> float:
    """The largest difference between two ways' losses, step by step, relative to the step's largest loss."""
    return max(float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30)) for a, b in zip(reference, other))


def baseline_session(pte: Path, manifest) -> ProgramSession:
    """A session of ``--baseline``, refused unless it takes the same steps as ``--program`` (the same config)."""
    from shared.manifest import read_manifest

    other = read_manifest(pte)
    if other.config != manifest.config:
        raise SystemExit(
            f"--baseline {pte}: another config than --program's ({other.config} against {manifest.config})"
        )
    return ProgramSession(pte, pte.parent / other.ptd.file, evaluate=False)


if __name__ == "__main__":
    main()
