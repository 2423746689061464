"""What a device's process needs to train with a program: the native runner's peak RSS against the manifest's
``memory_mb`` (``shared.program.memory_estimate_mb``, the figure the server's lease filter compares with a device's
free memory).

Each program runs ``--steps`` steps of real SST-2 rows (the agent's batches, ``benchmarks.agent.sst2_batches``) in
a fresh ``mobizo_runner`` process at full width (no ``--min-width``: every step at ``seq_len``, the memory plan's
own worst case); its peak RSS is the kernel's ``ru_maxrss`` of that one process (``os.wait4``). The runner is what
the ``adb`` backend runs on a phone; a Python agent (``executorch`` backend) holds the same program beside the
interpreter and torch it had already loaded before it leased the job.

    python -m benchmarks.runner_memory --programs A.pte [B.pte ...] [--steps 3] [--runner PATH]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.agent import sst2_batches
from device_agent.batches import write_batches
from device_agent.commands.agent import runner_default
from device_agent.local_data import program_shape
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


def runner_peak(runner: Path, pte: Path, steps: int) -> dict:
    """Runs ``steps`` steps of ``pte`` in one runner process → its manifest's figures and the process's peak."""
    manifest = read_manifest(pte)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        batches = folder / "batches.mzb"
        rows = sst2_batches(manifest, pte.parent / manifest.tokenizer.file, steps, folder)
        write_batches(batches, program_shape(manifest.config), rows)
        args = [str(runner), "--program", str(pte), "--data", str(pte.parent / manifest.ptd.file)]
        args += ["--batches", str(batches), "--eps", EPS, "--out-b", str(folder / "b.f32")]
        with open(folder / "out", "w") as out, open(folder / "err", "w") as err:
            subprocess.run([sys.executable, "-S", "-c", LAUNCH, str(folder / "peak"), *args], stdout=out, stderr=err)
        peak_kb, code = map(int, (folder / "peak").read_text().split())
        if code != 0:
            raise RuntimeError(f"{pte}: the runner exited {code}: {(folder / 'err').read_text()[-2000:]}")
        lines = (folder / "out").read_text().splitlines()
    return {
        "program": pte.as_posix(),
        "quantize": manifest.config.quantize,
        "steps": len(lines),
        "ptd_mb": manifest.ptd.size / 2**20,
        "memory_mb": manifest.memory_mb,
        "peak_mb": peak_kb / 1024,
    }


def print_table(rows: list[dict]) -> None:
    print("| program | quantize | .ptd MB | manifest memory_mb | runner peak RSS MB | estimate / peak |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ratio = r["memory_mb"] / r["peak_mb"]
        print(
            f"| {r['program']} | {r['quantize']} | {r['ptd_mb']:,.0f} | {r['memory_mb']:,} | {r['peak_mb']:,.0f} "
            f"| {ratio:.2f} |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=Path, nargs="+", required=True, help="training programs (FILE.pte)")
    parser.add_argument("--steps", type=int, default=3, help="steps each runner process runs")
    parser.add_argument("--runner", type=Path, default=None, help="the native runner (default: the one built here)")
    args = parser.parse_args(argv)
    runner = args.runner or runner_default()
    if not runner.is_file():
        parser.error(f"--runner: {runner} does not exist (build it: bash device_agent/runner/build.sh)")
    for pte in args.programs:
        if not pte.is_file():
            parser.error(f"--programs: {pte} does not exist")
    print_table([runner_peak(runner, pte, args.steps) for pte in args.programs])
    return 0


if __name__ == "__main__":
    sys.exit(main())
