"""How much faster is the parallel MobiZO step? Per-step time and memory of every method at one q·E.

Methods: ``mezo`` (full parameters), ``mezo-lora``, ``mobizo`` with each ``--parallel`` schedule, ``fo-lora``, and
``inference``: a plain ``no_grad`` forward of the same 2q·E rows a MobiZO step runs (the base model, LoRA idle), the
memory a step should not exceed ("training at the memory cost of inference"). The baselines use one query on the
whole batch, mobizo q queries of E = batch/q examples, so all do the same work per
step except for how it is grouped. They run INTERLEAVED (round-robin, after warm-up rounds) on one model, so
machine noise hits them alike; the table gives medians and ratios to ``mezo-lora``. The steps are the training
loop's own (``shared.train.MethodStep``), so what is timed is what trains. All share one model with LoRA injected;
``mezo`` runs it with the LoRA layers idle (no paths: each is its base layer plus one ``if``).

Memory, measured around each step:
- CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (peak = whole process, weights
  included; step = peak minus what was allocated before the step).
- CPU: the kernel's peak RSS (``VmHWM``), reset before each step by writing 5 to ``/proc/self/clear_refs``, after
  ``malloc_trim(0)`` hands freed heap pages back, so that a step's buffers must show up as new resident pages
  (step = peak minus RSS before the step). This counts what the allocator keeps resident during the step too
  (e.g. mezo's freed z buffers). Linux only; elsewhere the memory columns are empty.
The table shows the median step memory over the measured steps (robust to allocator noise) and the largest peak,
each also as a ratio to ``inference``.

Batches are synthetic: random tokens, exactly ``--seq-len`` long, no padding, one answer token per row. With
``--arch`` the model is a seeded random init of a named architecture, so nothing needs to be downloaded.

    python -m benchmarks.step_time --model DIR --q 1 --batch-size 16 --seq-len 64 --device cpu --json-out r.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.architectures import random_model
from shared.backends import PARALLEL_MODES
from shared.batch import Batch
from shared.errors import MobizoError, UsageError
from shared.files import atomic_write_bytes
from shared.hf_models import load_model
from shared.lora import inject_lora
from shared.noise import step_seed
from shared.train import MethodStep, resolve_device
from shared.zo import forward_losses

REFERENCE = "mezo-lora"
INFERENCE = "inference"
LR = {"mezo": 1e-6, "mezo-lora": 1e-4, "mobizo": 1e-4, "fo-lora": 1e-4}  # small: timing does not depend on them


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, metavar="DIR", help="Hugging Face model folder")
    source.add_argument("--arch", help="random init of tinyllama-1.1b, llama2-7b or smollm2-135m")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--q", type=int, default=1, help="MobiZO queries per step (must divide --batch-size)")
    parser.add_argument("--batch-size", type=int, default=1, help="examples per step (q·E)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per row")
    parser.add_argument("--steps", type=int, default=10, help="measured rounds (one step of each method per round)")
    parser.add_argument("--warmup", type=int, default=2, help="rounds run before measuring")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--targets", default="q_proj,v_proj")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice)")
    parser.add_argument("--json-out", type=Path, metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.q < 1 or args.batch_size % args.q:
        parser.error(f"argument --q: must divide --batch-size {args.batch_size}, got {args.q}")
    if min(args.batch_size, args.seq_len - 1, args.steps) < 1 or args.warmup < 0:
        parser.error("--batch-size and --steps must be >= 1, --seq-len >= 2, --warmup >= 0")
    return args


def load(args: argparse.Namespace, device: torch.device) -> tuple[torch.nn.Module, str]:
    if args.arch is not None:
        return random_model(args.arch, args.seed, args.dtype, str(device)), f"{args.arch} (random init)"
    model, _ = load_model(args.model, args.dtype, str(device))
    return model, str(args.model)


def synthetic_batch(vocab: int, rows: int, seq_len: int, seed: int, device: torch.device) -> Batch:
    """Full rows of random tokens; the last token of each row is its one answer token."""
    ids = torch.randint(0, vocab, (rows, seq_len), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    positions = torch.arange(seq_len).expand(rows, seq_len).contiguous()
    return Batch(ids.to(device), mask.to(device), positions.to(device), ids[:, -1:].contiguous().to(device))


# ---------------------------------------------------------------------------------------------------------------
# Memory probes: start() before a step, stop() after → (peak MB, step MB) or (None, None)


class CudaMemory:
    """Peak allocated CUDA memory of one step (the caching allocator's own count, not nvidia-smi's)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start(self) -> None:
        torch.cuda.synchronize(self.device)
        self.before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def stop(self) -> tuple[float, float]:
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        return peak / 2**20, (peak - self.before) / 2**20


class CpuMemory:
    """Peak RSS of one step (Linux: /proc), see the module docstring."""

    def __init__(self) -> None:
        try:
            self.libc = ctypes.CDLL("libc.so.6")
            self._reset_peak()
            self.available = True
        except OSError:
            self.available = False

    @staticmethod
    def _status_mb(field: str) -> float:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
        raise OSError(f"no {field} in /proc/self/status")

    @staticmethod
    def _reset_peak() -> None:
        Path("/proc/self/clear_refs").write_text("5")

    def start(self) -> None:
        if self.available:
            self.libc.malloc_trim(0)
            self.before = self._status_mb("VmRSS")
            self._reset_peak()

    def stop(self) -> tuple[float | None, float | None]:
        if not self.available:
            return None, None
        peak = self._status_mb("VmHWM")
        return peak, peak - self.before


# ---------------------------------------------------------------------------------------------------------------
# Measuring


@dataclass
class Entry:
    """One benchmarked method: its step, its batch, and the samples taken."""

    label: str
    step: Callable[[Batch, int], object]  # (batch, seed): a MethodStep, or InferenceStep
    batch: Batch
    times: list[float]
    peaks: list[float]
    deltas: list[float]


class InferenceStep:
    """A plain forward under ``no_grad`` (the base model: the LoRA layers idle) — what serving the model costs."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __call__(self, batch: Batch, seed: int) -> torch.Tensor:
        with torch.no_grad():
            return forward_losses(self.model, batch)


def doubled(batch: Batch) -> Batch:
    """The 2q·E rows of a step's paths (each row twice: the ± pair), as one inference batch."""
    return Batch(
        *(torch.cat([x, x]) for x in (batch.input_ids, batch.attention_mask, batch.position_ids, batch.targets))
    )


def entries(args: argparse.Namespace, model: torch.nn.Module, device: torch.device) -> list[Entry]:
    targets = tuple(t for t in args.targets.split(",") if t)
    lora = inject_lora(model, targets, args.rank, args.alpha)
    batch = synthetic_batch(model.config.vocab_size, args.batch_size, args.seq_len, args.seed, device)
    plan = [("mezo", "mezo", 1, "both"), ("mezo-lora", "mezo-lora", 1, "both")]
    plan += [(f"mobizo-{mode}", "mobizo", args.q, mode) for mode in PARALLEL_MODES]
    plan += [("fo-lora", "fo-lora", 1, "both")]
    steps = [
        Entry(label, MethodStep(method, model, lora, q, mode, LR[method], 1e-2), batch, [], [], [])
        for label, method, q, mode in plan
    ]
    return steps + [Entry(INFERENCE, InferenceStep(model), doubled(batch), [], [], [])]


def measure(items: list[Entry], rounds: int, warmup: int, probe, device: torch.device, seed: int) -> None:
    """Round-robin over the methods; the first ``warmup`` rounds are not recorded."""
    for k in range(warmup + rounds):
        for item in items:
            probe.start()
            start = time.perf_counter()
            item.step(item.batch, step_seed(seed, k))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - start
            peak, delta = probe.stop()
            if k >= warmup:
                item.times.append(elapsed)
                if peak is not None:
                    item.peaks.append(peak)
                    item.deltas.append(delta)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratio(value: float | None, reference: float | None) -> float | None:
    return value / reference if value is not None and reference else None


def summarize(items: list[Entry]) -> dict[str, dict]:
    """Medians (time; step memory, robust to allocator noise), the largest peak, ratios to mezo-lora and to
    inference."""
    ref = next(i for i in items if i.label == REFERENCE)
    ref_time, ref_delta = statistics.median(ref.times), _median(ref.deltas)
    inference = next(i for i in items if i.label == INFERENCE)
    inf_delta, inf_peak = _median(inference.deltas), max(inference.peaks, default=None)
    out = {}
    for item in items:
        time_s, delta = statistics.median(item.times), _median(item.deltas)
        peak = max(item.peaks, default=None)
        out[item.label] = {
            "median_s": time_s,
            "time_ratio": time_s / ref_time,
            "peak_mb": peak,
            "step_mb": delta,
            "step_mb_ratio": _ratio(delta, ref_delta),
            "step_mb_vs_inference": _ratio(delta, inf_delta),
            "peak_mb_vs_inference": _ratio(peak, inf_peak),
            "times_s": item.times,
        }
    return out


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(results: dict[str, dict]) -> str:
    lines = [
        f"| method | s/step (median) | time × {REFERENCE} | step memory MB | memory × {REFERENCE} | "
        f"memory × {INFERENCE} | peak MB | peak × {INFERENCE} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, r in results.items():
        lines.append(
            f"| {label} | {r['median_s']:.4f} | {r['time_ratio']:.2f} | {_fmt(r['step_mb'], '.1f')} | "
            f"{_fmt(r['step_mb_ratio'], '.2f')} | {_fmt(r['step_mb_vs_inference'], '.2f')} | "
            f"{_fmt(r['peak_mb'], '.0f')} | {_fmt(r['peak_mb_vs_inference'], '.2f')} |"
        )
    return "\n".join(lines)


def environment(device: torch.device) -> dict:
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "device": str(device),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def report(args: argparse.Namespace, name: str, device: torch.device, results: dict[str, dict]) -> None:
    """Print the header line and the table; write the JSON file if asked."""
    env = environment(device)
    where = env.get("gpu", f"threads={env['threads']}")
    print(
        f"{name} | {args.dtype} | {env['device']} ({where}) | q={args.q} batch={args.batch_size} "
        f"(E={args.batch_size // args.q}) seq={args.seq_len} | median of {args.steps} interleaved steps"
    )
    print(table(results))
    if args.json_out is not None:
        setup = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        payload = {"model": name, "setup": setup, "environment": env, "results": results}
        atomic_write_bytes(args.json_out, (json.dumps(payload, indent=2) + "\n").encode())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        device = resolve_device(args.device)
        model, name = load(args, device)
        items = entries(args, model, device)
    except MobizoError as exc:  # unknown --arch, --dtype, --targets, unloadable --model, ...
        print(f"step_time.py: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, UsageError) else 1
    measure(
        items, args.steps, args.warmup, CudaMemory(device) if device.type == "cuda" else CpuMemory(), device, args.seed
    )
    report(args, name, device, summarize(items))
    return 0


if __name__ == "__main__":
    sys.exit(main())
