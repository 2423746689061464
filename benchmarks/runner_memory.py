"""What a device's process needs to train with a program: the native runner's peak RSS against the manifest's
``memory_mb`` (``shared.program.memory_estimate_mb``, the figure the server's lease filter compares with a device's
free memory), and, with ``--inference``, against the inference forward of the same rows on the same runtime.

Each program runs ``--steps`` steps of real SST-2 rows (the agent's batches, ``benchmarks.agent.sst2_batches``) in
a fresh ``mobizo_runner`` process at full width (no ``--min-width``: every step at ``seq_len``, the memory plan's
own worst case); its peak RSS is the kernel's ``ru_maxrss`` of that one process (``os.wait4``), loading included.
The runner is what the ``adb`` backend runs on a phone; a Python agent (``executorch`` backend) holds the same
program beside the interpreter and torch it had already loaded before it leased the job.

``--inference`` names, for each training program in order, the plain forward of the base model over the same 2q·E
rows (``benchmarks.program``'s ``inference`` program, its weights in the folder of its name); ``--export-inference
DIR`` exports them instead (or reuses them from DIR), from the model and the shapes each training program's
manifest names, at its base weights (float32 or 8da4w), one export for programs of one shape: the runner's
``forward`` mode runs it ``--steps`` times in a fresh process on the step's own rows (each row twice, as the step's
± paths see it; its ``--batches``), and the table gives the step's peak and time over
the inference forward's, the device's own step-to-inference ratios (no interpreter on either side). Time per call
is the runner's own clock around ``forward``: the median of the calls after the first (the first allocates the
delegate's workspace). With ``--repeats R`` each program runs in R processes, a step program's each followed by its
inference program's, so that a drift in the machine's speed falls on both sides of the ratio. Both sides read the
same tokens: a device maps in the pages of the embedding rows its tokens look up (an 8da4w program's int8 table,
31 MB for SmolLM2, is read that way, not packed), so rows of ones would leave most of them out of the inference
side's peak.

    python -m benchmarks.runner_memory --programs A.pte [B.pte ...]
        [--inference A-inference.pte ... | --export-inference DIR] [--steps 3] [--repeats 1] [--runner PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.agent import sst2_batches
from benchmarks.program import INFERENCE, export_measured, inference_weights, program_path
from device_agent.batches import write_batches
from device_agent.local_data import program_shape
from device_agent.runner_path import runner_default
from shared.manifest import read_manifest

EPS = "1e-2"
# A process's peak RSS (ru_maxrss) starts from the memory of the process it was forked from, and survives the exec:
# a runner forked from this Python process would report this process's size where its own is smaller. So a bare
# interpreter (a few MB) spawns it and reports the runner's own peak, as GNU time does.
LAUNCH = """import os, sys
pid = os.posix_spawn(sys.argv[2], sys.argv[2:], os.environ)
_, status, usage = os.wait4(pid, 0)
open(sys.argv[1], "w").write(f"{usage.ru_maxrss} {os.waitstatus_to_exitcode(status)}")
"""


def _run(args: list[str], folder: Path, what: Path) -> tuple[float, list[dict]]:
    """Runs the runner with ``args`` in a fresh process → (its own peak RSS in MB, its stdout's JSON lines)."""
    with open(folder / "out", "w") as out, open(folder / "err", "w") as err:
        subprocess.run([sys.executable, "-S", "-c", LAUNCH, str(folder / "peak"), *args], stdout=out, stderr=err)
    peak_kb, code = map(int, (folder / "peak").read_text().split())
    if code != 0:
        raise RuntimeError(f"{what}: the runner exited {code}: {(folder / 'err').read_text()[-2000:]}")
    return peak_kb / 1024, [json.loads(line) for line in (folder / "out").read_text().splitlines()]


def _seconds(lines: list[dict]) -> float:
    """The median time of the calls after the first (the first allocates the delegate's workspace)."""
    times = [line["seconds"] for line in lines]
    return statistics.median(times[1:] if len(times) > 1 else times)


def write_sst2_batches(pte: Path, steps: int, folder: Path) -> Path:
    """``steps`` steps of real SST-2 rows for the training program ``pte`` as the agent builds them, in a batches
    file in ``folder`` (the same rows for a program's step and for its inference forward) → its path."""
    manifest = read_manifest(pte)
    batches = folder / "batches.mzb"
    rows = sst2_batches(manifest, pte.parent / manifest.tokenizer.file, steps, folder)
    write_batches(batches, program_shape(manifest.config), rows)
    return batches


def runner_peak(runner: Path, pte: Path, batches: Path, folder: Path) -> dict:
    """Runs the steps of ``batches`` with ``pte`` in one runner process → its manifest's figures and the process's
    peak."""
    manifest = read_manifest(pte)
    args = [str(runner), "--program", str(pte), "--data", str(pte.parent / manifest.ptd.file)]
    args += ["--batches", str(batches), "--eps", EPS, "--out-b", str(folder / "b.f32")]
    peak_mb, lines = _run(args, folder, pte)
    return {
        "program": pte.as_posix(),
        "kind": "step",
        "quantize": manifest.config.quantize,
        "steps": len(lines),
        "ptd_mb": manifest.ptd.size / 2**20,
        "memory_mb": manifest.memory_mb,
        "peak_mb": peak_mb,
        "seconds": _seconds(lines),
    }


def forward_peak(runner: Path, pte: Path, batches: Path, calls: int, folder: Path) -> dict:
    """Runs ``calls`` forwards of the inference program ``pte`` (its weights: ``inference_weights``) over the rows
    of ``batches`` (the step program's, each row twice) in one runner process → the process's peak and the time
    of a call."""
    ptd = inference_weights(pte)
    args = [str(runner), "forward", "--program", str(pte), "--data", str(ptd), "--iterations", str(calls)]
    peak_mb, lines = _run([*args, "--batches", str(batches)], folder, pte)
    return {
        "program": pte.as_posix(),
        "kind": "inference",
        "quantize": "",
        "steps": len(lines),
        "ptd_mb": ptd.stat().st_size / 2**20,
        "memory_mb": None,
        "peak_mb": peak_mb,
        "seconds": _seconds(lines),
    }


def print_table(rows: list[dict], pairs: list[tuple[dict, dict]]) -> None:
    print("| program | kind | quantize | .ptd MB | manifest memory_mb | runner peak RSS MB | s/call", end="")
    print(" | estimate / peak |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        estimate = "—" if r["memory_mb"] is None else f"{r['memory_mb']:,}"
        ratio = "—" if r["memory_mb"] is None else f"{r['memory_mb'] / r['peak_mb']:.2f}"
        print(
            f"| {r['program']} | {r['kind']} | {r['quantize'] or '—'} | {r['ptd_mb']:,.0f} | {estimate} "
            f"| {r['peak_mb']:,.0f} | {r['seconds']:.4f} | {ratio} |"
        )
    if pairs:
        print()
        print("| step program | peak ÷ inference's | s/call ÷ inference's |")
        print("|---|---|---|")
        for step, inference in pairs:
            print(
                f"| {step['program']} | {step['peak_mb'] / inference['peak_mb']:.2f} "
                f"| {step['seconds'] / inference['seconds']:.2f} |"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=Path, nargs="+", required=True, help="training programs (FILE.pte)")
    parser.add_argument(
        "--inference",
        type=Path,
        nargs="+",
        default=[],
        help="for each training program in order, benchmarks.program's inference program of the same rows",
    )
    parser.add_argument(
        "--export-inference",
        type=Path,
        default=None,
        metavar="DIR",
        help="export (or reuse from DIR) each training program's inference program of the same rows, from the "
        "model its manifest names",
    )
    parser.add_argument("--steps", type=int, default=3, help="steps (forward calls) each runner process runs")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="processes per program, each step program's followed by its inference program's (a drift in the "
        "machine's speed falls on both sides): the peak is the largest, the time the median of their medians",
    )
    parser.add_argument("--runner", type=Path, default=None, help="the native runner (default: the one built here)")
    args = parser.parse_args(argv)
    runner = args.runner or runner_default()
    if not runner.is_file():
        parser.error(f"--runner: {runner} does not exist (build it: bash device_agent/runner/build.sh)")
    for pte in args.programs:
        if not pte.is_file():
            parser.error(f"--programs: {pte} does not exist")
    if args.inference and args.export_inference:
        parser.error("--inference and --export-inference: give one")
    if args.export_inference:
        args.inference = [exported_inference(pte, args.export_inference, parser) for pte in args.programs]
    if args.inference and len(args.inference) != len(args.programs):
        parser.error(f"--inference: {len(args.inference)} programs for {len(args.programs)} training programs")
    for pte in args.inference:
        if not pte.is_file() or not inference_weights(pte).is_file():
            parser.error(f"--inference: {pte} or its weights {inference_weights(pte)} does not exist")
    if args.steps < 1 or args.repeats < 1:
        parser.error("--steps and --repeats must be at least 1")
    runs: dict[tuple[str, int], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        batches = [write_sst2_batches(pte, args.steps, Path(tempfile.mkdtemp(dir=tmp))) for pte in args.programs]
        for _ in range(args.repeats):
            for i, pte in enumerate(args.programs):
                runs.setdefault(("step", i), []).append(runner_peak(runner, pte, batches[i], folder))
                if args.inference:
                    inference = forward_peak(runner, args.inference[i], batches[i], args.steps, folder)
                    runs.setdefault(("inference", i), []).append(inference)
    steps = [_pooled(runs["step", i]) for i in range(len(args.programs))]
    inference = [_pooled(runs["inference", i]) for i in range(len(args.inference))]
    print_table(steps + inference, list(zip(steps, inference)))
    return 0


def exported_inference(pte: Path, workdir: Path, parser: argparse.ArgumentParser) -> Path:
    """``benchmarks.program``'s inference program of the training program ``pte``'s rows and base weights, exported
    into ``workdir`` from the model its manifest names (reused when there) → its path."""
    manifest = read_manifest(pte)
    if manifest.model is None or not Path(manifest.model, "config.json").is_file():
        parser.error(f"--export-inference: {pte}'s manifest names no model folder here ({manifest.model})")
    out = program_path(workdir, manifest.config, INFERENCE)
    if not out.is_file():
        print(f"exporting the inference program of {pte} to {out} ...", file=sys.stderr, flush=True)
    workdir.mkdir(parents=True, exist_ok=True)
    export_measured(Path(manifest.model), manifest.config, out, INFERENCE)
    return out


def _pooled(rows: list[dict]) -> dict:
    """One program's processes as one row: the largest peak, the median of the processes' times per call."""
    return {
        **rows[0],
        "steps": sum(r["steps"] for r in rows),
        "peak_mb": max(r["peak_mb"] for r in rows),
        "seconds": statistics.median(r["seconds"] for r in rows),
    }


if __name__ == "__main__":
    sys.exit(main())
