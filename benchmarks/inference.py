"""How fast and how big is on-device inference with the inference program, next to eager PyTorch?

Exports (or takes, ``--program``) a model's inference program, then for each thread count times, interleaved
round-robin with eager PyTorch + KV cache (``shared.generation.EagerStepper``) after a warm-up: the prefill of a
``--prompt-len``-token prompt and ``--decode`` greedy decode steps, both in tokens/s; the time to swap an adapter
(``set_lora_b``); the peak RSS of a process that loads the program and generates (a child per thread count); and
the bytes a device holds for the base plus N adapters (program + weights + tokenizer + N B files) against the
host's (the model folder + N PEFT adapters).

    python -m benchmarks.inference --model DIR [--max-context 256 --prompt-len 64 --decode 32 --threads 1 2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def _rounds(program, eager, prompt: list[int], decode: int, repeats: int) -> dict[str, list[float]]:
    """Seconds of prefill and of the decode steps, per engine, alternating which goes first."""
    from shared.generation import Sampling, generate

    times: dict[str, list[float]] = {k: [] for k in ("pte_prefill", "pte_decode", "eager_prefill", "eager_decode")}
    for r in range(repeats + 1):  # round 0 is the warm-up
        engines = [("pte", lambda: program), ("eager", eager)]
        for name, make in engines if r % 2 else engines[::-1]:
            steps = list(generate(make(), prompt, decode + 1, Sampling()))
            if r:
                times[f"{name}_prefill"].append(steps[0].seconds)
                times[f"{name}_decode"].append(sum(s.seconds for s in steps[1:]) / decode)
    return times


def _peak_mb() -> float:
    """This process's peak resident memory (VmHWM). Not ``ru_maxrss``: Linux carries that across ``execve``, so a
    spawned child would report its parent's peak (the export's)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def _child(args: dict, threads: int, queue) -> None:
    """One thread count in a fresh process, so that its peak RSS is this run's own."""
    from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

    from device_agent.inference import InferenceSession
    from shared.generation import EagerStepper
    from shared.hf_models import load_model
    from shared.manifest import read_inference_manifest

    torch.set_num_threads(threads)
    _unsafe_reset_threadpool(threads)
    pte = Path(args["program"])
    manifest = read_inference_manifest(pte)
    rss_imports = _peak_mb()
    session = InferenceSession(pte, pte.parent / manifest.ptd.file, manifest)
    rss_program = _peak_mb()
    prompt = torch.randint(3, manifest.vocab_size, (args["prompt_len"],), generator=torch.Generator().manual_seed(0))
    b = torch.randn(manifest.lora_size, generator=torch.Generator().manual_seed(1)).numpy() * 0.01
    session.set_b(b)
    from shared.generation import Sampling, generate

    list(generate(session, prompt.tolist(), args["decode"] + 1, Sampling()))  # the program alone, generating
    rss_after_program = _peak_mb()
    model, _ = load_model(Path(args["model"]))
    times = _rounds(session, lambda: EagerStepper(model), prompt.tolist(), args["decode"], args["repeats"])
    swaps = []
    for i in range(20):
        started = time.perf_counter()
        session.set_b(b if i % 2 else None)
        swaps.append(time.perf_counter() - started)
    queue.put(
        {
            "threads": threads,
            "times": times,
            "swap_s": statistics.median(swaps),
            "rss_program_mb": rss_program,
            "rss_imports_mb": rss_imports,
            "rss_peak_mb": _peak_mb(),
            "rss_before_eager_mb": rss_after_program,
        }
    )


def _bytes_on_device(program: Path, model_dir: Path, adapters: list[int]) -> list[dict]:
    """Device: program + weights + tokenizer + N B files; host: the model folder + N PEFT adapters (A and B)."""
    from shared.b_file import b_file_bytes
    from shared.manifest import read_inference_manifest

    manifest = read_inference_manifest(program)
    base = program.stat().st_size + manifest.ptd.size + manifest.tokenizer.size
    b_bytes = len(b_file_bytes(torch.zeros(manifest.lora_size).numpy()))
    host_base = sum(p.stat().st_size for p in model_dir.iterdir() if p.is_file())
    a_and_b = 4 * sum(m.in_features + m.out_features for m in manifest.lora) * manifest.config.rank
    return [
        {"adapters": n, "device_bytes": base + n * b_bytes, "host_bytes": host_base + n * a_and_b} for n in adapters
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--program", type=Path, help="an exported inference program (default: export one)")
    parser.add_argument("--max-context", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 10])
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        program = args.program
        if program is None:
            from shared.inference_program import export_inference_program
            from shared.manifest import InferenceConfig

            program = Path(tmp) / "inference.pte"
            export_inference_program(args.model, InferenceConfig(max_context=args.max_context), program)
        rows = []
        for threads in args.threads:
            queue = mp.get_context("spawn").Queue()
            child_args = {
                "program": str(program),
                "model": str(args.model),
                "prompt_len": args.prompt_len,
                "decode": args.decode,
                "repeats": args.repeats,
            }
            proc = mp.get_context("spawn").Process(target=_child, args=(child_args, threads, queue))
            proc.start()
            row = queue.get()
            proc.join()
            t = {k: statistics.median(v) for k, v in row["times"].items()}
            rows.append(
                {
                    "threads": threads,
                    "prefill_tok_s": {
                        "pte": args.prompt_len / t["pte_prefill"],
                        "eager": args.prompt_len / t["eager_prefill"],
                    },
                    "decode_tok_s": {"pte": 1 / t["pte_decode"], "eager": 1 / t["eager_decode"]},
                    "swap_ms": 1000 * row["swap_s"],
                    "rss_mb": {
                        "runtime_imported": row["rss_imports_mb"],
                        "program_loaded": row["rss_program_mb"],
                        "program_generating": row["rss_before_eager_mb"],
                        "with_eager_too": row["rss_peak_mb"],
                    },
                }
            )
        sizes = _bytes_on_device(program, args.model, args.adapters)
    print(
        f"{'threads':>7} {'prefill tok/s pte / eager (ratio)':>36} "
        f"{'decode tok/s pte / eager (ratio)':>36} {'swap ms':>8}"
    )
    for r in rows:
        p, d = r["prefill_tok_s"], r["decode_tok_s"]
        print(
            f"{r['threads']:>7} {p['pte']:>12.1f} / {p['eager']:>8.1f} ({p['pte'] / p['eager']:.2f}x)"
            f"       {d['pte']:>10.1f} / {d['eager']:>8.1f} ({d['pte'] / d['eager']:.2f}x) {r['swap_ms']:>8.3f}"
        )
        print(
            f"        peak RSS: torch + runtime imported {r['rss_mb']['runtime_imported']:.0f} MB, "
            f"program loaded {r['rss_mb']['program_loaded']:.0f} MB, generating "
            f"{r['rss_mb']['program_generating']:.0f} MB "
            f"(eager model loaded after: {r['rss_mb']['with_eager_too']:.0f} MB)"
        )
    for s in sizes:
        print(
            f"bytes for base + {s['adapters']} adapters: device {s['device_bytes']:,} (program, .ptd, tokenizer, "
            f"B files); host {s['host_bytes']:,} (model folder + PEFT adapters)"
        )
    if args.json_out:
        args.json_out.write_text(json.dumps({"rows": rows, "sizes": sizes}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
