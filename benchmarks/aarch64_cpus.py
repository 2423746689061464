"""The device program on emulated aarch64 CPUs: does each CPU's upload still replay bit for bit, and how far do its
losses move from this machine's?

The same program, batches and flags run in this machine's runner (``device_agent/runner/build.sh``) and in the runner
cross-built for aarch64 (``build.sh --aarch64``) under ``qemu-aarch64 -cpu C`` for each ``--cpu C``. Per program and
CPU: the largest difference of the step-0 losses from this machine's (the same B, the same rows: only the kernels
differ), the steps whose losses are this machine's bits, the final B's elements that differ from this machine's and
the largest difference, and whether that CPU's final B is the replay of its own log bit for bit (what the server
checks of an upload). qemu's step times are an emulator's, not a device's: none is printed.

    python -m benchmarks.aarch64_cpus --programs A.pte [B.pte ...] [--steps 20]
        [--cpu cortex-a76 --cpu "max,sme=off" ...] [--qemu qemu-aarch64 --qemu PATH ...] [--runner-aarch64 PATH]

Each ``--qemu`` (a qemu-aarch64 binary; default the one on PATH) runs every ``--cpu``: two qemu versions tell an
emulator's error from a kernel's difference.

Needs qemu-user and the aarch64 C library (``bash scripts/aarch64.sh``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.runner_memory import write_sst2_batches
from device_agent.runner_path import RUNNER_BUILD as RUNNER
from shared.manifest import read_manifest

CPUS = ["cortex-a53", "cortex-a76", "neoverse-n1", "max,sme=off", "max"]
EPS = "1e-2"
SYSROOT = "/usr/aarch64-linux-gnu"  # Debian's libc6-arm64-cross


def run_steps(command: list[str], pte: Path, batches: Path, out_b: Path) -> tuple[list[dict], np.ndarray]:
    """The runner's step lines and final B for the steps of ``batches`` from B = 0."""
    manifest = read_manifest(pte)
    args = ["--program", str(pte), "--data", str(pte.parent / manifest.ptd.file), "--batches", str(batches)]
    done = subprocess.run(
        [*command, *args, "--eps", EPS, "--out-b", str(out_b)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)}: exited {done.returncode}: {done.stderr[-2000:]}")
    return [json.loads(line) for line in done.stdout.splitlines()], np.fromfile(out_b, dtype=np.float32)


def replays(lines: list[dict], b: np.ndarray, optimizer: str) -> bool:
    """Whether ``b`` is the replay of the runner's log from B = 0, bit for bit."""
    import torch

    from shared.replay import replay

    replayed = replay(torch.zeros(b.size), lines, optimizer).numpy()
    return np.array_equal(replayed.view(np.int32), b.view(np.int32))


def losses(lines: list[dict]) -> np.ndarray:
    return np.array([line["losses"] for line in lines], dtype=np.float32)


def qemu_version(qemu: str) -> str:
    """``qemu-aarch64 version 7.2.22 (...)`` → ``qemu 7.2.22``."""
    first = subprocess.run([qemu, "--version"], capture_output=True, text=True, check=True).stdout.split()
    return f"qemu {first[2]}"


def compare(pte: Path, cpus: list[str], qemus: list[str], steps: int, runner_aarch64: Path, folder: Path) -> list[dict]:
    """One row per (qemu, CPU), this machine's first, for program ``pte``."""
    manifest = read_manifest(pte)
    batches = write_sst2_batches(pte, steps, folder)
    host_lines, host_b = run_steps([str(RUNNER / "mobizo_runner")], pte, batches, folder / "host.f32")
    rows = [("", "this machine", host_lines, host_b)]
    for qemu in qemus:
        for cpu in cpus:
            emulator = [qemu, "-cpu", cpu, "-L", SYSROOT, str(runner_aarch64)]
            lines, b = run_steps(emulator, pte, batches, folder / "cpu.f32")
            rows.append((qemu_version(qemu), cpu, lines, b))
    host = losses(host_lines)
    out = []
    for emulator, cpu, lines, b in rows:
        these = losses(lines)
        out.append(
            {
                "program": pte.parent.name,
                "quantize": manifest.config.quantize,
                "emulator": emulator,
                "cpu": cpu,
                "step0_max_diff": float(np.abs(these[0] - host[0]).max()),
                "same_steps": int(sum(np.array_equal(x.view(np.int32), y.view(np.int32)) for x, y in zip(these, host))),
                "steps": len(lines),
                "b_differ": int(np.count_nonzero(b != host_b)),
                "b_max_diff": float(np.abs(b - host_b).max()),
                "d": int(b.size),
                "replays": replays(lines, b, manifest.config.optimizer),
            }
        )
    return out


def print_table(rows: list[dict]) -> None:
    print(
        f"{'program':<18} {'quantize':<8} {'emulator':<13} {'cpu':<14} {'step-0 loss diff':>16} {'same-bit steps':>14} "
        f"{'B elements differ':>17} {'max |dB|':>9} {'B = replay':>10}"
    )
    for r in rows:
        print(
            f"{r['program']:<18} {r['quantize']:<8} {r['emulator']:<13} {r['cpu']:<14} {r['step0_max_diff']:>16.3g} "
            f"{r['same_steps']:>6} of {r['steps']:<6} {r['b_differ']:>7} of {r['d']:<7} {r['b_max_diff']:>9.2g} "
            f"{'yes' if r['replays'] else 'NO':>10}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", nargs="+", type=Path, required=True, help="training programs (.pte)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cpu", action="append", help=f"a qemu -cpu value, repeatable (default: {', '.join(CPUS)})")
    parser.add_argument("--qemu", action="append", help="a qemu-aarch64 binary, repeatable (default: on PATH)")
    parser.add_argument("--runner-aarch64", type=Path, default=RUNNER / "aarch64-linux-gnu" / "mobizo_runner")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    for path in (RUNNER / "mobizo_runner", args.runner_aarch64):
        if not path.is_file():
            parser.error(f"no runner at {path} (device_agent/runner/build.sh [--aarch64])")
    rows = []
    for pte in args.programs:
        with tempfile.TemporaryDirectory() as tmp:
            rows += compare(
                pte, args.cpu or CPUS, args.qemu or ["qemu-aarch64"], args.steps, args.runner_aarch64, Path(tmp)
            )
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
