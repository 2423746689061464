"""Where a program's step spends its time on the device runtime: an ETDump profile of ``forward``, per operator.

For each ``--programs`` training program (its manifest beside it, its ``.ptd`` in the same folder) it loads the
program with ETDump on, sets B to zeros and runs ``forward`` ``--steps`` times on random tokens, after one warm-up
step (whose XNNPACK weight packing is not a step's cost), the programs' steps interleaved. It groups the profiled
events: XNNPACK's own operators (``Fully Connected``, ``Batch Matrix Multiply``, ...: the delegate reports them
numbered, and they are summed per kind) and the portable operators outside the delegate (``native_call_*``). It
prints, per program, milliseconds per step for the whole ``Method::execute`` and for each group, so two schedules
(``--parallel both`` against ``none``) can be compared line by line::

    python -m benchmarks.program_profile --programs both.pte none.pte --steps 10 --threads 1 [--top 12]

With ``--inference FILE.pte`` (the ``inference`` program of the same cell) it profiles, beside them, the plain
forward of the base model over the same rows as the first program's step (each row twice: the ± pair), so that
what a step costs over inference is named operator by operator. The programs are the ones ``benchmarks.program``
writes in its ``--workdir``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

# Events that contain other events (a delegate call, an operator call around its kernel): their time is the sum of
# what they contain, so they are left out; the method's own event (``Method::execute``) is kept as the total.
_WRAPPERS = {"OPERATOR_CALL", "DELEGATE_CALL"}


def _load(pte: Path, ptd: Path):
    """The program with ETDump on."""
    from executorch.extension.pybindings.portable_lib import _load_for_executorch

    from device_agent.native_log import runtime_log_filtered

    with runtime_log_filtered():
        return _load_for_executorch(str(pte), data_path=str(ptd), enable_etdump=True)


def _load_training(pte: Path):
    """(training program with ETDump on and B set to zeros, its config)."""
    from shared.manifest import read_manifest

    manifest = read_manifest(pte)
    module = _load(pte, pte.parent / manifest.ptd.file)
    module.run_method("set_lora_b", (torch.zeros(manifest.lora_size),))
    return module, manifest.config


def _load_inference(pte: Path):
    """An inference program of ``benchmarks.program`` (its weights file named in ``FILE.export.json``)."""
    ptd = Path(json.loads(pte.with_suffix(".export.json").read_text())["ptd"])
    return _load(pte, ptd)


def _grouped(module, steps: int) -> dict[str, float]:
    """Median milliseconds per ``forward`` of the whole method (``total``) and of each operator group, leaving out
    the first (warm-up) forward."""
    from executorch.devtools import Inspector

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "profile.etdp"
        module.write_etdump_result_to_file(str(path))
        inspector = Inspector(etdump_path=str(path))
    per_step: dict[str, list[float]] = defaultdict(lambda: [0.0] * steps)
    for block in inspector.event_blocks:
        for event in block.events:
            raw = event.perf_data.raw if event.perf_data is not None else []
            if len(raw) != steps + 1:  # not an event of every forward (set_lora_b, loading)
                continue
            if event.name == "Method::execute":
                key = "total"
            elif event.name in _WRAPPERS:
                continue
            elif event.is_delegated_op:
                key = "xnnpack: " + re.sub(r" #\d+$", "", event.name)
            else:
                key = "portable: " + event.name.removeprefix("native_call_")
            for k, ms in enumerate(raw[1:]):
                per_step[key][k] += ms
    return {key: statistics.median(values) for key, values in per_step.items()}


def profile_programs(ptes: list[Path], steps: int, inference: Path | None = None) -> list[dict[str, float]]:
    """Each program's ``_grouped`` profile, then ``inference``'s (over the first program's rows) when given; their
    forwards interleaved, step after step, so that every program sees the same machine state."""
    from benchmarks.program import INFERENCE, _inputs

    loaded = [(*_load_training(pte), "step") for pte in ptes]
    if inference is not None:
        loaded.append((_load_inference(inference), loaded[0][1], INFERENCE))
    vocab = 256  # ids below 256 exist in every byte-level vocabulary; a step's cost does not depend on them
    for k in range(steps + 1):
        for module, cfg, kind in loaded:
            module.run_method("forward", tuple(_inputs(cfg, vocab, k, kind)))
    return [_grouped(module, steps) for module, _, _ in loaded]


def print_profiles(names: list[str], profiles: list[dict[str, float]], top: int) -> None:
    """One row per operator group (the ``top`` largest of the first program, then the rest summed), ms/step."""
    first = profiles[0]
    groups = sorted((key for key in first if key != "total"), key=lambda key: -first[key])
    shown = groups[:top]
    print("| ms per step | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))

    def row(label: str, values: list[float]) -> None:
        print(f"| {label} | " + " | ".join(f"{v:.1f}" for v in values) + " |")

    row("**whole step (Method::execute)**", [p.get("total", 0.0) for p in profiles])
    for kind in ("xnnpack", "portable"):
        row(f"all {kind} operators", [sum(v for k, v in p.items() if k.startswith(kind)) for p in profiles])
    for key in shown:
        row(key, [p.get(key, 0.0) for p in profiles])
    rest = [sum(v for k, v in p.items() if k != "total" and k not in shown) for p in profiles]
    row("everything else", rest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=Path, nargs="+", required=True, help="training programs (.pte)")
    parser.add_argument("--steps", type=int, default=10, help="profiled steps per program (after one warm-up)")
    parser.add_argument("--threads", type=int, default=1, help="XNNPACK threadpool size (and torch's threads)")
    parser.add_argument("--top", type=int, default=12, help="operator groups shown apart")
    parser.add_argument(
        "--inference",
        type=Path,
        help="benchmarks.program's inference program of the first program's cell, profiled over the same rows",
    )
    args = parser.parse_args(argv)
    for pte in args.programs:
        if not pte.is_file():
            parser.error(f"--programs: no such file: {pte}")
    if args.inference is not None and not args.inference.with_suffix(".export.json").is_file():
        parser.error(f"--inference: not an inference program of benchmarks.program (no .export.json): {args.inference}")
    from benchmarks.program import _set_threads

    _set_threads(args.threads)
    profiles = profile_programs(args.programs, args.steps, args.inference)
    names = [pte.stem for pte in args.programs] + ([args.inference.stem] if args.inference is not None else [])
    print_profiles(names, profiles, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
